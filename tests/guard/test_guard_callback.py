"""`trainer/callbacks.py` on its own: which guard method each Trainer event calls, and where the guard's callback runs
among the Trainer's: after transformers' `DefaultFlowCallback` decided whether the step logs, saves or ends training,
and before the Trainer saves; the skip flag goes to the optimizer the Trainer passes (or `trainer.optimizer`)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import DefaultFlowCallback

from safe_trainers.testing.build import build_trainer
from safe_trainers.trainer import callbacks as callback_module
from safe_trainers.trainer.callbacks import NanGuardCallback


class RecordingGuard:
    """Stands in for a [`NanGuard`] to see which of its doors each event calls, with what (the trainer is real
    elsewhere in this file); `due` answers in turn from `due`."""

    def __init__(self, due: list[tuple[bool, bool] | None]):
        self.calls: list[tuple] = []
        self.answers = list(due)

    def apply_skip(self, optimizer):
        self.calls.append(("apply_skip", optimizer))

    def after_update(self, optimizer):
        self.calls.append(("after_update", optimizer))

    def due(self, control):
        self.calls.append(("due", control))
        return self.answers.pop(0)


class RecordingInspection:
    """Stands in for `trainer/inspection.py` (what the callback has carried out on the trainer), recording into the
    guard's calls."""

    def __init__(self, guard: RecordingGuard):
        self.guard = guard

    def begin(self, trainer):
        self.guard.calls.append(("begin", trainer))

    def inspect(self, trainer, verify=False, snapshot=False, fresh=False):
        self.guard.calls.append(("inspect", trainer, verify, snapshot, fresh))

    def before_write(self, trainer):
        self.guard.calls.append(("before_write", trainer))


def test_each_trainer_event_calls_its_guard_method(monkeypatch):
    own, passed = object(), object()
    guard = RecordingGuard(due=[(True, False), None])  # the step's end: due (verify, no snapshot); the epoch's: not
    trainer = SimpleNamespace(optimizer=own, safe_run=SimpleNamespace(guard=guard, callbacks_read_only=False))
    monkeypatch.setattr(callback_module, "inspection", RecordingInspection(guard))  # this module's name only
    callback = NanGuardCallback(trainer)
    args, state, control = None, TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control)
    callback.on_pre_optimizer_step(args, state, control, optimizer=passed)
    callback.on_optimizer_step(args, state, control, optimizer=passed)
    callback.on_pre_optimizer_step(args, state, control)  # no optimizer passed: the trainer's own
    callback.on_optimizer_step(args, state, control, optimizer=None)
    callback.on_step_end(args, state, control)
    callback.on_epoch_end(args, state, control)
    callback.on_train_end(args, state, control)
    assert guard.calls == [
        ("begin", trainer),
        # the update waits (on the device) for a snapshot's copies still in flight: after the skip flag, before it
        ("apply_skip", passed), ("before_write", trainer), ("after_update", passed),
        ("apply_skip", own), ("before_write", trainer), ("after_update", own),
        ("due", control),  # the step's and the epoch's end: inspect when due, with the flow's decisions
        ("inspect", trainer, True, False, False),
        ("due", control),
        ("inspect", trainer, False, False, False),  # the end of training: whatever is pending
    ]  # fmt: skip
    # The events the guard has no part in call nothing.
    for event in ("on_step_begin", "on_log", "on_save", "on_evaluate", "on_substep_end", "on_epoch_begin"):
        getattr(callback, event)(args, state, control)
    assert len(guard.calls) == 11


@pytest.fixture
def trained(toy_models, tmp_path):
    """A guarded SFT trainer after a 2-step run: its optimizer is accelerate's wrapper around a fused AdamW."""
    trainer = build_trainer("sft", toy_models["qwen2"], tmp_path / "out", preset="guarded", max_steps=2)
    trainer.train()
    return trainer


def _fused_adamw() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)
    return param, torch.optim.AdamW([param], lr=0.1, fused=True)


@pytest.mark.parametrize("fault", [True, False])
def test_the_skip_flag_goes_to_the_optimizer_the_trainer_passes(trained, fault):
    callback = next(cb for cb in trained.callback_handler.callbacks if isinstance(cb, NanGuardCallback))
    guard, own = trained.nan_guard, trained.optimizer.optimizer  # the fused AdamW inside accelerate's wrapper
    param, passed = _fused_adamw()
    guard.flags.fault_now = torch.tensor(fault)  # the device flag of the step just closed
    args, state, control = trained.args, trained.state, trained.control
    callback.on_pre_optimizer_step(args, state, control, optimizer=passed)
    assert float(passed.found_inf) == float(fault) and "found_inf" not in vars(own)
    passed.step()
    assert torch.equal(param.detach(), torch.ones(4)) is fault  # the faulted step's update is not applied
    callback.on_optimizer_step(args, state, control, optimizer=passed)
    assert "found_inf" not in vars(passed)  # taken back after the step: no later step, no pickle carries it

    # No optimizer passed: the trainer's own (through accelerate's wrapper) gets the flag, and gives it back.
    callback.on_pre_optimizer_step(args, state, control, optimizer=None)
    assert float(own.found_inf) == float(fault)
    callback.on_optimizer_step(args, state, control, optimizer=None)
    assert "found_inf" not in vars(own)


def test_the_guard_sees_the_flow_callbacks_decisions_and_inspects_before_the_save(toy_models, tmp_path):
    out = tmp_path / "out"
    # Logs every 2 steps, saves every 4 (the preset), a guard snapshot every 3: steps 1..6.
    trainer = build_trainer(
        "sft", toy_models["qwen2"], out, preset="guarded", max_steps=6, logging_steps=2, nan_snapshot_steps=3
    )
    callbacks = trainer.callback_handler.callbacks
    flow = next(i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback))
    ours = next(i for i, cb in enumerate(callbacks) if isinstance(cb, NanGuardCallback))
    assert flow < ours

    guard, seen, judged = trainer.nan_guard, [], []
    real_judge = guard.judge

    def judge(*args, **kwargs):
        verdict = real_judge(*args, **kwargs)
        judged.append(verdict)
        return verdict

    guard.judge = judge  # this guard object's own method, wrapped to see whether it judged

    def at_boundary(event):
        def seeing(args, state, control, **kwargs):
            step = state.global_step
            before = (control.should_log, control.should_save, control.should_training_stop)
            judged.clear()
            event(args, state, control, **kwargs)
            published = os.path.isdir(out / f"checkpoint-{step}")
            inspected = any(verdict is not None for verdict in judged)
            seen.append((step, *before, inspected, guard.snapshotter.snapshot.step, published))

        return seeing

    callback = callbacks[ours]  # this callback object's own events, wrapped to see what the guard saw
    callback.on_step_end, callback.on_epoch_end = at_boundary(callback.on_step_end), at_boundary(callback.on_epoch_end)
    trainer.train()
    # (step, should_log, should_save, should_training_stop, inspected, snapshot step after it, checkpoint on disk)
    assert seen == [
        (1, False, False, False, False, 0, False),
        (2, True, False, False, True, 0, False),  # a log: inspected, no snapshot
        (3, False, False, False, True, 3, False),  # `nan_snapshot_steps`: inspected and a snapshot
        (4, True, True, False, True, 4, False),  # a save: verified and a snapshot, before the checkpoint is written
        (5, False, False, False, False, 4, False),
        (6, True, True, True, True, 6, False),  # the last step: the flow asks to save and stop
        # `on_epoch_end` after the last step (the epoch loop ended): the log and save are done and reset, the stop
        # stands, so the state is verified (and snapshotted) once more; checkpoint-6 is published by now.
        (6, False, False, True, True, 6, True),
    ]
    assert os.path.isdir(out / "checkpoint-4") and os.path.isdir(out / "checkpoint-6")
    assert guard.flags.pending == []  # `on_train_end` inspected whatever was left
