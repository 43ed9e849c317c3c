"""Checkpoints written in the background (`save_in_background=True`): training goes on while the files are written,
and every reader of a checkpoint (`on_save`, the hub upload, the rotation, the step record, the best model, a
preemption's exit, a resume) sees it only once it is published. The writer is held in the middle of a checkpoint's
files (`safe_trainers/testing/held_writes.py`) so the tests look while it is half-written; real training on CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import trl
from guard_utils import checkpoint_steps
from transformers import TrainerCallback

import safe_trainers as st
from safe_trainers.restarts.preemption import Preempted
from safe_trainers.runtime.checkpoint_dirs import STAGING_DIR
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.held_writes import hold_writes
from safe_trainers.trainer.mixin import SafeTrainerMixin

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
         "training_args.bin", "nan_guard_state.json")  # fmt: skip


class _RecordingPushSFT(trl.SFTTrainer):
    pushed: list

    def init_hf_repo(self, token=None, private=None):
        self.pushed = []

    def _push_from_checkpoint(self, checkpoint_folder):
        self.pushed.append(os.path.basename(checkpoint_folder))


class RecordingPushSFTTrainer(SafeTrainerMixin, _RecordingPushSFT):
    _safety_kind = "sft"
    _safety_config_class = st.SFTConfig
    _trl_class = trl.SFTTrainer


class _Readers(TrainerCallback):
    """Records each `on_save` (step, whether every file is there) and, at `look_at`, what the readers see of the
    checkpoint held in flight, then releases the writer."""

    def __init__(self, trainer, out: str, look_at: int):
        self.trainer, self.out, self.look_at = trainer, out, look_at
        self.saved, self.seen, self.held = [], None, None

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(self.out, f"checkpoint-{state.global_step}")
        self.saved.append((state.global_step, all(os.path.isfile(os.path.join(path, f)) for f in FILES)))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.look_at:
            assert self.held.holding.wait(120)  # the writer is in the middle of the checkpoint's files
            run = self.trainer.safe_run
            self.seen = dict(
                published=checkpoint_steps(self.out),
                saved=[s for s, _ in self.saved],
                pushed=list(getattr(self.trainer, "pushed", [])),
                record=run.progress.history.checkpoints,
            )
            self.held.release()


def test_training_goes_on_while_a_checkpoint_is_written_and_its_readers_wait(toy_models, tmp_path):
    out = str(tmp_path)
    trainer = build_trainer(
        "sft", toy_models["qwen2"], out, preset="guarded",
        save_in_background=True, trainer_cls=RecordingPushSFTTrainer, max_steps=8,
        save_steps=2, save_total_limit=1, push_to_hub=True, hub_strategy="checkpoint", hub_model_id="local/test",
    )  # fmt: skip
    readers = _Readers(trainer, out, look_at=5)
    trainer.add_callback(readers)
    readers.held = hold_writes(trainer, step=4)
    trainer.train()
    # Step 5 trained while checkpoint-4 was half-written: nothing read it, and the rotation kept checkpoint-2.
    assert readers.seen == dict(published=[2], saved=[2], pushed=["checkpoint-2"], record=(2,))
    assert readers.saved == [(2, True), (4, True), (6, True), (8, True)]  # each once published, with its own step
    assert trainer.pushed == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert checkpoint_steps(out) == [8] and not os.path.exists(os.path.join(out, STAGING_DIR))
    assert trainer.safe_run.progress.history.checkpoints == (8,)


def test_the_best_checkpoint_in_flight_is_published_before_it_is_loaded_and_never_rotated(toy_models, tmp_path):
    out = str(tmp_path)
    trainer = build_trainer(
        "sft", toy_models["qwen2"], out, preset="guarded",
        save_in_background=True, eval_rows=4, max_steps=6, save_steps=2, eval_steps=2,
        eval_strategy="steps", save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
    )  # fmt: skip
    readers = _Readers(trainer, out, look_at=3)
    trainer.add_callback(readers)
    readers.held = hold_writes(trainer, step=2)
    trainer.train()
    assert readers.seen["published"] == [] and readers.saved[0] == (2, True)
    best = trainer.state.best_model_checkpoint
    assert best is not None and STAGING_DIR not in best and os.path.isdir(best)
    assert os.path.basename(best) in os.listdir(out)  # the rotation kept it beside the newest
    with open(os.path.join(out, "checkpoint-6", "trainer_state.json")) as f:
        assert f'"best_model_checkpoint": "{best}"' in f.read()


def test_a_preemption_exits_only_once_its_checkpoint_is_published(toy_models, tmp_path):
    # checkpoint-2 is written in the background and held; a preemption stops the run at step 3, whose checkpoint is
    # written in line (the loop ends after it: a host copy would only delay the exit). The exit waits for both.
    out = str(tmp_path)
    trainer = build_trainer("sft", toy_models["qwen2"], out, preset="guarded",
        save_in_background=True, max_steps=8, save_steps=2)

    class SignalAt3(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step + 1 == 3:
                os.kill(os.getpid(), signal.SIGUSR1)

    trainer.add_callback(SignalAt3())
    held = hold_writes(trainer, step=2, on_hold=lambda: threading.Timer(0.5, lambda: held.release()).start())
    with pytest.raises(Preempted) as caught:
        trainer.train()
    assert caught.value.step == 3 and held.holding.is_set() and held.started == [2]
    for step in (2, 3):
        assert all(os.path.isfile(os.path.join(out, f"checkpoint-{step}", f)) for f in FILES)
    assert checkpoint_steps(out) == [2, 3] and trainer.safe_run.progress.history.checkpoints == (2, 3)


def test_stock_trainer_resumes_from_a_checkpoint_written_in_the_background(toy_models, tmp_path):
    out = str(tmp_path / "safe")
    trainer = build_trainer("sft", toy_models["qwen2"], out, preset="guarded",
        save_in_background=True, max_steps=4, save_steps=2)
    trainer.train()
    stock = build_trainer(
        "sft", toy_models["qwen2"], str(tmp_path / "stock"), preset="guarded", max_steps=6, save_steps=100,
        trainer_cls=trl.SFTTrainer, config_cls=trl.SFTConfig,
    )  # fmt: skip
    stock.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    assert stock.state.global_step == 6
    assert any(h.get("step") == 5 for h in stock.state.log_history)  # it went on from step 4, not from scratch


_KILLED_SCRIPT = """
import os, sys, time
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.held_writes import hold_writes

model, out, marker = sys.argv[1:4]
trainer = build_trainer("sft", model, out, preset="guarded",
        save_in_background=True, max_steps=8, save_steps=2)
hold_writes(trainer, step=4, on_hold=lambda: open(marker, "w").close())  # SIGKILLed while it holds
trainer.train()
"""


def test_a_sigkill_during_a_background_write_leaves_the_previous_checkpoint_and_the_restart_resumes_from_it(
    toy_models, tmp_path
):
    out, marker, script = str(tmp_path / "out"), str(tmp_path / "holding"), tmp_path / "run.py"
    script.write_text(textwrap.dedent(_KILLED_SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), toy_models["qwen2"], out, marker], env=env)
    try:
        for _ in range(600):
            if os.path.exists(marker) or proc.poll() is not None:
                break
            threading.Event().wait(0.5)
        assert os.path.exists(marker), f"the writer never held checkpoint-4 (exit status {proc.poll()})"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    staged = os.path.join(out, STAGING_DIR, "checkpoint-4")
    assert checkpoint_steps(out) == [2]  # checkpoint-4 is half-written in staging, never published
    assert os.path.isdir(staged) and not os.path.exists(staged + ".complete")
    assert not os.path.isfile(os.path.join(staged, "optimizer.pt"))  # held after the weights
    restarted = build_trainer("sft", toy_models["qwen2"], out, preset="guarded",
        save_in_background=True, max_steps=8, save_steps=2)
    restarted.train(resume_from_checkpoint=True)
    assert restarted.nan_guard.resumed_from == os.path.join(out, "checkpoint-2")
    assert checkpoint_steps(out) == [2, 4, 6, 8] and not os.path.exists(os.path.join(out, STAGING_DIR))


def test_a_rollback_from_disk_waits_for_the_checkpoint_in_flight(toy_models, tmp_path):
    # `nan_rollback_from="checkpoint"`: checkpoint-4 is held mid-write for 3 s while steps 5 and 6 train; NaN weights
    # at step 6. The rollback's source is the newest published checkpoint: it waits for checkpoint-4 (a good state,
    # verified before it was staged) instead of going back to checkpoint-0.
    from safe_trainers.guard import read_events
    from safe_trainers.testing.faults import Fault

    trainer = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path), preset="guarded", faults=[Fault(step=6, kind="weight")],
        nan_rollback_from="checkpoint", save_in_background=True, max_steps=8, save_steps=4,
    )  # fmt: skip
    held = hold_writes(trainer, 4, on_hold=lambda: threading.Timer(3.0, held.release).start())
    trainer.train()
    [rollback] = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    assert rollback["restored_step"] == 4 and held.holding.is_set()


def test_a_starting_checkpoint_in_flight_is_the_disk_sources_good_state(toy_models, tmp_path):
    # `nan_rollback_from="checkpoint"` publishes the starting state as checkpoint-0, in the background; its writer is
    # held until step 4 ends (30 s at most), so the snapshots of steps 2 and 4 find no published good state yet. They
    # must not publish their own (checkpoint-0 in flight is the good state); NaN weights at step 6 go back to step 0.
    from transformers import TrainerCallback

    from safe_trainers.guard import read_events
    from safe_trainers.testing.faults import Fault

    class ReleaseAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                held.release()

    trainer = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path), preset="guarded", faults=[Fault(step=6, kind="weight")],
        nan_rollback_from="checkpoint", save_in_background=True, max_steps=8, save_steps=100,
    )  # fmt: skip
    held = hold_writes(trainer, 0, on_hold=lambda: threading.Timer(30.0, held.release).start())  # never a deadlock
    trainer.add_callback(ReleaseAt())
    trainer.train()
    [rollback] = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    assert (rollback["restored_step"], held.holding.is_set()) == (0, True)
    assert checkpoint_steps(str(tmp_path)) == [0, 8]


def test_the_starting_checkpoint_written_in_the_background_is_never_uploaded(toy_models, tmp_path):
    # checkpoint-0 (`nan_rollback_from="checkpoint"`'s starting state) is the guard's, never the user's: a synchronous
    # save does not push it, and neither does its announcement at a later step boundary.
    trainer = build_trainer(
        "sft", toy_models["qwen2"], str(tmp_path), preset="guarded", nan_rollback_from="checkpoint",
        save_in_background=True, trainer_cls=RecordingPushSFTTrainer, max_steps=4, save_steps=2, push_to_hub=True,
        hub_strategy="checkpoint", hub_model_id="local/test",
    )  # fmt: skip
    trainer.train()
    assert checkpoint_steps(str(tmp_path)) == [0, 2, 4]
    assert trainer.pushed == ["checkpoint-2", "checkpoint-4"]


def test_the_first_background_save_finds_its_host_buffers_ready(toy_models, tmp_path):
    # Allocated on a thread after the first step (the optimizer's moments exist), not on the first save's path; let go
    # when `train()` returns.
    from transformers import TrainerCallback

    trainer = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path), preset="guarded", save_in_background=True, max_steps=8,
        save_steps=4,
    )  # fmt: skip
    buffers = trainer.safe_run.saves.buffers
    seen = []

    class AtSecondSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 8:
                seen.extend((held.allocations, held.allocation_seconds, held.nbytes() > 0) for held in buffers_held())

    def buffers_held():
        return buffers.model, buffers.optimizer

    trainer.add_callback(AtSecondSave())
    trainer.train()
    assert seen == [(1, 0.0, True)] * 2
    assert checkpoint_steps(str(tmp_path)) == [4, 8]
    assert buffers.model.nbytes() == buffers.optimizer.nbytes() == 0  # not held past `train()`


def test_a_rollback_keeps_the_best_checkpoint_still_being_written(toy_models, tmp_path):
    # Evaluation, snapshot and save at step 4 (checkpoint-4 the best); NaN in the update of step 5, a rollback to
    # step 4 while checkpoint-4 is still being written (held until the training thread waits for it). The rollback
    # waits for it: the restored best-model fields name a published checkpoint-4, and the worse evaluation at step 8
    # does not replace it.
    from safe_trainers.guard import read_events
    from safe_trainers.testing.faults import Fault
    from safe_trainers.testing.held_writes import hold_until_waited

    scores = iter([0.5, 0.9])
    trainer = build_trainer(
        "reward", toy_models["qwen2-rm"], str(tmp_path), preset="guarded", faults=[Fault(step=5, kind="update")],
        eval_rows=4, max_steps=8, eval_strategy="steps", eval_steps=4, save_steps=4, load_best_model_at_end=True,
        metric_for_best_model="score", greater_is_better=False, nan_snapshot_steps=4, save_in_background=True,
    )  # fmt: skip
    trainer.compute_metrics = lambda prediction: {"score": next(scores)}
    held = hold_until_waited(trainer, 4, probe=lambda: trainer.state.global_step)
    trainer.train()
    assert [e["restored_step"] for e in read_events(str(tmp_path)) if e["kind"] == "rollback"] == [4]
    assert held.waits == [6]  # the rollback at step 6 waited for checkpoint-4
    assert trainer.state.best_metric == 0.5 and trainer.state.best_model_checkpoint.endswith("checkpoint-4")
