"""`guard/nan_guard.py` on its own: the [`NanGuard`] of a real tiny guarded trainer, driven through its public methods in
the order the Trainer's doors call them (`trainer_hooks.py`, `callback.py`), one optimizer step at a time, with real
faults from `safe_trainers.testing.faults`. Each test states one contract of `NanGuard` (the NaN-step path of
`docs/design/layout.md`)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import TrainerControl

from safe_trainers.runtime.events import read_events
from safe_trainers.guard.step.skip import route_for
from safe_trainers.guard.rollback.memory import HostSnapshot
from safe_trainers.guard.state import GuardState
from safe_trainers.trainer.hooks import NanGuardTrainerMixin
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault, FaultInjector, first_trainable_matrix


class Driver:
    """Plays the Trainer's part around a guard: each `step()` is one optimizer step of one micro-batch, calling the
    guard where the Trainer's doors do (the loss after the forward, the step's end after clipping, the skip before
    `optimizer.step()`), with the faults of a [`FaultInjector`] fired at their steps."""

    def __init__(self, trainer, faults=()):
        self.trainer, self.guard = trainer, trainer.nan_guard
        trainer.create_optimizer_and_scheduler(num_training_steps=trainer.args.max_steps)
        trainer.state.max_steps = trainer.args.max_steps
        self.injector = FaultInjector(list(faults))
        self.injector.on_train_begin(trainer.args, trainer.state, trainer.control, model=trainer.model)
        self.batches = iter(trainer.get_train_dataloader())

    def begin(self) -> None:
        self.guard.start_run(None)  # `train()`
        self.guard.begin()  # `on_train_begin`

    def forward(self, record: bool = True) -> torch.Tensor:
        trainer = self.trainer
        self.injector.on_step_begin(trainer.args, trainer.state, trainer.control, optimizer=trainer.optimizer)
        trainer.model.train()
        inputs = trainer._prepare_inputs(next(self.batches))
        if record:
            self.guard.record_inputs(inputs)  # `compute_loss`
        # The trainer's own loss, past the guard's door (which would record the inputs a second time).
        loss = super(NanGuardTrainerMixin, trainer).compute_loss(trainer.model, inputs)
        loss.backward()
        return loss.detach()

    def clip(self) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.trainer.model.parameters(), 1.0)

    def close(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The guard's hot path for a step whose loss is `loss`: returns the device skip flag."""
        self.guard.observe_loss(loss)  # `training_step`
        skip = self.guard.end_of_step(grad_norm)  # `_get_grad_norm`
        self.guard.apply_skip(self.trainer.optimizer)  # `on_pre_optimizer_step`
        return skip

    def update(self) -> None:
        trainer = self.trainer
        trainer.optimizer.step()
        self.guard.flags.after_update(trainer.optimizer)  # `on_optimizer_step`
        self.injector.on_optimizer_step(trainer.args, trainer.state, trainer.control, optimizer=trainer.optimizer)
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.state.global_step += 1

    def step(self, record: bool = True) -> torch.Tensor:
        loss = self.forward(record)
        skip = self.close(loss, self.clip())
        self.update()
        return skip


def build(toy_models, tmp_path, faults=(), **config) -> Driver:
    config.setdefault("max_steps", 8)
    trainer = build_trainer("sft", toy_models["qwen2"], tmp_path / "out", preset="guarded", **config)
    return Driver(trainer, faults)


def trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def optimizer_state(trainer) -> list[torch.Tensor]:
    opt = trainer.optimizer
    return [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def poison_a_weight(trainer) -> None:
    with torch.no_grad():
        first_trainable_matrix(trainer.model).view(-1)[0] = float("nan")


# The calls that bring a tensor's value to the host.
HOST_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
})  # fmt: skip


class HostReads(TorchFunctionMode):
    """Counts the calls of [`HOST_READS`] made inside it (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`...), on any
    tensor."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------------- start
def test_begin_binds_to_the_optimizer_and_snapshots_the_starting_state(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    before = trainable(driver.trainer)
    driver.begin()
    guard = driver.guard
    assert guard.backend.optimizer is driver.trainer.optimizer and guard.backend.zero_stage is None
    assert guard.rollback_from == "memory" and isinstance(guard.snapshotter, HostSnapshot)
    snap = guard.snapshotter.snapshot
    assert snap.step == 0 and same(snap.params, before)  # the weights training starts from, copied
    assert guard.verified_step == 0 and guard.flags.pending == []


def test_begin_refuses_a_state_that_is_already_nonfinite(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    poison_a_weight(driver.trainer)
    with pytest.raises(ValueError, match=r"already non-finite before the first step \(rank\(s\) \[0\]\)"):
        driver.begin()


def test_a_new_run_undoes_the_previous_backoff_and_a_resumed_one_keeps_its_counters(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    driver.begin()
    guard, optimizer = driver.guard, driver.trainer.optimizer
    lr = optimizer.param_groups[0]["lr"]
    guard.state.lr_scale, guard.state.skipped_steps = 0.25, 3
    optimizer.param_groups[0]["lr"] = lr * 0.25  # as two rollbacks at `nan_lr_backoff=0.5` left it
    guard.start_run(None)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr) and guard.state == GuardState(learning_rate=1e-3)

    checkpoint = tmp_path / "out" / "checkpoint-6"
    checkpoint.mkdir(parents=True)
    GuardState(skipped_steps=2, rollbacks=1, lr_scale=0.5, learning_rate=1e-3).save(str(checkpoint))
    guard.start_run(str(checkpoint))
    assert (guard.state.skipped_steps, guard.state.rollbacks, guard.state.lr_scale) == (2, 1, 0.5)
    assert guard.resumed_from == str(checkpoint) and guard.rollbacks_this_run == 0


def test_a_changed_learning_rate_on_resume_is_scaled_to_with_the_backoff_kept(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    driver.begin()
    guard, optimizer = driver.guard, driver.trainer.optimizer
    guard.state.learning_rate = 4e-3  # the run was configured with 4e-3; now `learning_rate=1e-3`
    optimizer.param_groups[0]["lr"] = 2e-3  # its checkpoint's LR: 4e-3 after one backoff of 0.5
    guard.resumed_learning_rate(optimizer, driver.trainer.lr_scheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3) and guard.state.learning_rate == 1e-3


# ---------------------------------------------------------------------------------------------------- the hot path
def test_a_nonfinite_loss_sets_the_skip_flag_on_the_device_without_a_host_read(toy_models, tmp_path):
    driver = build(toy_models, tmp_path, faults=[Fault(step=1, kind="loss")])
    driver.begin()
    guard = driver.guard
    assert route_for(driver.trainer.optimizer, None) == "found_inf"  # fused AdamW: skipped on the device
    loss = driver.forward()
    assert math.isnan(loss.item())  # the injected fault
    grad_norm = driver.clip()
    with HostReads() as reads:
        skip = driver.close(loss, grad_norm)
    assert reads.reads == []  # observe_loss, end_of_step and apply_skip read nothing back
    assert torch.is_tensor(skip) and bool(skip)
    assert len(guard.flags.pending) == 1 and guard.events.events == [] and guard.state.skipped_steps == 0
    driver.update()
    with HostReads() as reads:
        verdict = guard.inspect(driver.trainer.control)
    assert reads.reads  # the inspection is where the flags come back to the host
    assert [r.step for r in verdict.skipped] == [1] and verdict.rollback is None


def test_apply_skip_keeps_the_faulted_update_out_of_the_weights_and_the_optimizer(toy_models, tmp_path):
    driver = build(toy_models, tmp_path, faults=[Fault(step=2, kind="loss")])
    driver.begin()
    before = trainable(driver.trainer)
    assert not bool(driver.step())  # a healthy step is applied
    applied = trainable(driver.trainer)
    assert not same(applied, before)
    moments = optimizer_state(driver.trainer)
    assert bool(driver.step())  # NaN loss, NaN gradients: skipped
    assert same(trainable(driver.trainer), applied)  # not one weight moved, none went NaN
    after = optimizer_state(driver.trainer)
    assert len(after) == len(moments) and all(torch.equal(a, b) for a, b in zip(after, moments))  # step count too
    assert "found_inf" not in vars(driver.trainer.optimizer)  # taken back after the step


def test_inspect_records_the_skip_with_the_module_that_went_nonfinite(toy_models, tmp_path):
    driver = build(toy_models, tmp_path, faults=[Fault(step=2, kind="loss")])
    driver.begin()
    driver.step(), driver.step()
    guard = driver.guard
    verdict = guard.inspect(driver.trainer.control)
    assert [r.step for r in verdict.skipped] == [2] and verdict.rollback is None and guard.flags.pending == []
    (event,) = [e for e in guard.events.events]
    # NaN activations make a NaN loss on rank 0, and NaN gradients.
    assert (event.step, event.kind, event.nonfinite, event.ranks) == (2, "skip", ["loss", "grad_norm"], [0])
    layers = driver.trainer.model.config.num_hidden_layers
    # The fault poisons the last decoder layer's output: the replay names that layer.
    assert event.detail["first_nonfinite_module"]["module"] == f"model.layers.{layers - 1}"
    assert guard.state.skipped_steps == 1 and guard.state.counters()["nan_guard/skipped_steps"] == 1
    assert [e["kind"] for e in read_events(str(tmp_path / "out"))] == ["skip"]  # written to `nan_events.jsonl`


def test_record_inputs_keeps_the_steps_batches_for_the_diagnosis_until_the_inspection(toy_models, tmp_path):
    driver = build(toy_models, tmp_path, faults=[Fault(step=1, kind="loss"), Fault(step=2, kind="loss")])
    driver.begin()
    guard = driver.guard
    driver.step()
    (batch,) = guard.batches.get(1)  # one micro-batch, its inputs as the model got them
    assert batch["input_ids"].shape[0] == driver.trainer.args.per_device_train_batch_size
    guard.inspect(driver.trainer.control)
    assert guard.batches.get(1) == []  # dropped at the inspection
    assert "first_nonfinite_module" in guard.events.events[0].detail
    guard.state.localized = False  # the diagnosis runs once per run: allow another
    driver.step(record=False)
    guard.inspect(driver.trainer.control)
    skip = guard.events.events[1]
    assert (skip.step, skip.kind) == (2, "skip") and "first_nonfinite_module" not in skip.detail  # nothing to replay


def test_at_boundary_inspects_only_where_the_trainer_logs_saves_or_a_snapshot_is_due(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)  # `nan_snapshot_steps=2` (the preset)
    driver.begin()
    guard = driver.guard
    driver.step()
    assert guard.at_boundary(TrainerControl()) is None and len(guard.flags.pending) == 1  # nothing due at step 1
    driver.step()
    assert guard.at_boundary(TrainerControl()) is not None  # step 2: a snapshot is due
    assert guard.flags.pending == [] and guard.snapshotter.snapshot.step == 2
    driver.step()
    assert guard.at_boundary(TrainerControl(should_log=True)) is not None  # a log: inspected, no snapshot
    assert guard.snapshotter.snapshot.step == 2
    driver.step(), driver.step()  # steps 4 (a snapshot, not asked for here) and 5
    assert guard.at_boundary(TrainerControl(should_save=True)) is not None  # a save: verified, a snapshot
    assert guard.snapshotter.snapshot.step == 5 and guard.verified_step == 5


# ---------------------------------------------------------------------------------------------------- the state
def test_state_is_finite_flips_with_a_nan_weight_and_a_verified_step_is_trusted(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    driver.begin()
    guard = driver.guard
    driver.step()
    assert guard.state_is_finite() and guard.damaged_ranks == [] and guard.verified_step == 1
    poison_a_weight(driver.trainer)
    assert guard.state_verified()  # step 1 was verified: not checked again at the same step
    assert not guard.state_is_finite() and guard.damaged_ranks == [0]
    assert not guard.state_verified()  # a check that found damage takes the step's verification back


def test_a_nan_in_the_optimizer_state_is_found_too(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    driver.begin()
    driver.step()
    moment = next(iter(driver.trainer.optimizer.state.values()))["exp_avg_sq"]
    moment.view(-1)[0] = float("nan")
    assert not driver.guard.state_is_finite()


def test_take_snapshot_copies_the_state_of_this_step(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    driver.begin()
    driver.step()
    driver.guard.take_snapshot()
    snap = driver.guard.snapshotter.snapshot
    assert snap.step == 1 and same(snap.params, trainable(driver.trainer))
    assert snap.optimizer_state  # the moments exist after the first update, and are held
    kept = {n: t.clone() for n, t in snap.params.items()}
    driver.step()
    assert same(snap.params, kept)  # a copy: training on does not change it


# ---------------------------------------------------------------------------------------------------- recovery
def test_a_damaged_state_is_rolled_back_to_the_snapshot_exactly(toy_models, tmp_path):
    # A bad update at step 3: the loss stays finite, a weight turns NaN after the optimizer step.
    driver = build(toy_models, tmp_path, faults=[Fault(step=3, kind="update")])
    driver.begin()
    guard, trainer = driver.guard, driver.trainer
    driver.step(), driver.step()
    assert guard.at_boundary(TrainerControl()) is not None  # the snapshot of step 2
    good, good_moments = trainable(trainer), optimizer_state(trainer)
    lr = trainer.optimizer.param_groups[0]["lr"]
    assert not bool(driver.step())  # step 3's update is applied, then damaged
    assert driver.injector.injected == [(3, "update")]
    verdict = guard.inspect(trainer.control, verify=True)
    assert verdict.rollback == "nonfinite_state"
    assert same(trainable(trainer), good)  # the snapshot's weights, bit for bit
    moments = optimizer_state(trainer)
    assert len(moments) == len(good_moments) and all(torch.equal(a, b) for a, b in zip(moments, good_moments))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.5)  # `nan_lr_backoff`
    assert trainer.state.global_step == 3  # the timeline never rewinds
    (event,) = guard.events.events
    assert (event.step, event.kind) == (3, "rollback")
    assert event.detail["restored_step"] == 2 and event.detail["discarded_steps"] == [3]
    assert event.detail["reason"] == "nonfinite_state" and "weights_or_optimizer_state" in event.nonfinite
    assert (guard.state.rollbacks, guard.rollbacks_this_run, guard.state.discarded_steps) == (1, 1, 1)
    assert guard.state.lr_scale == 0.5 and guard.verified_step == 3 and guard.flags.pending == []


def test_skips_in_a_row_roll_back(toy_models, tmp_path):
    driver = build(toy_models, tmp_path, faults=[Fault(step=1, kind="loss", repeat=3)], nan_max_consecutive_skips=3)
    driver.begin()
    snapshot = trainable(driver.trainer)
    for _ in range(3):
        assert bool(driver.step())
    verdict = driver.guard.inspect(driver.trainer.control)
    assert [r.step for r in verdict.skipped] == [1, 2, 3] and verdict.rollback == "consecutive_skips"
    assert verdict.fault_step == 1
    assert [e.kind for e in driver.guard.events.events] == ["skip", "skip", "skip", "rollback"]
    assert same(trainable(driver.trainer), snapshot)


def test_before_publishing_verifies_afresh_what_a_later_callback_may_have_damaged(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    driver.begin()
    guard = driver.guard
    driver.step(), driver.step()
    guard.at_boundary(TrainerControl())  # verified at step 2, snapshot taken
    good = trainable(driver.trainer)
    poison_a_weight(driver.trainer)  # e.g. a callback after the guard's
    guard.before_publishing(TrainerControl())  # no save, no evaluation: nothing checked
    assert guard.events.events == []
    guard.before_publishing(TrainerControl(should_save=True))
    assert [e.kind for e in guard.events.events] == ["rollback"] and same(trainable(driver.trainer), good)


def test_finish_puts_back_a_state_damaged_after_the_last_check(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    driver.begin()
    guard = driver.guard
    driver.step(), driver.step()
    guard.at_boundary(TrainerControl(should_training_stop=True))  # the last check, with a snapshot of step 2
    good = trainable(driver.trainer)
    guard.finish()  # healthy: nothing to do
    assert guard.events.events == []
    poison_a_weight(driver.trainer)
    guard.finish()
    (event,) = guard.events.events
    assert (event.kind, event.detail["reason"], event.detail["restored_step"]) == (
        "restore", "damaged_after_last_check", 2,
    )  # fmt: skip
    assert same(trainable(driver.trainer), good) and guard.state.rollbacks == 0  # no backoff, no counter


def test_finish_before_training_began_does_nothing(toy_models, tmp_path):
    driver = build(toy_models, tmp_path)
    poison_a_weight(driver.trainer)
    driver.trainer.nan_guard.finish()  # no snapshot to restore, no check: `train()` failed before `on_train_begin`
    assert driver.trainer.nan_guard.events.events == []
