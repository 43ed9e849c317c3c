"""A preemption at the end of a run, and what the hang watchdog times: a signal during or after the last step keeps
the finished run (published, exit 75, nothing trained or saved again on restart), on one process and on one rank of
two; each `train()` call learns its own hang bound; the diagnosis replay is not timed, the guard's verification
before a save or an evaluation is.
"""

from __future__ import annotations

import os
import signal
from typing import ClassVar

import pytest
from guard_utils import nonfinite_in_checkpoints
from test_crash_restarts import launch_restarting, steps
from transformers import TrainerCallback

from safe_trainers.guard import read_events
from safe_trainers.restarts.preemption import PREEMPTED_EXIT_CODE, Preempted
from safe_trainers.restarts.progress import read_progress
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.trainers import trainer_class


class _SignalAfterLastStep(TrainerCallback):
    """Sends the process a signal once the last step is done (after the preemption callback looked at it), as a
    signal during the last step's logging or evaluation, or the end of training, arrives."""

    def __init__(self, sig: signal.Signals):
        self.sig = sig

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == state.max_steps:
            os.kill(os.getpid(), self.sig)


def test_a_signal_after_the_last_step_keeps_the_finished_run(toy_models, tmp_path):
    # `save_strategy="no"` and a SIGTERM once the last step is done: the process exited 75 ("preempted, resumable")
    # with no checkpoint, and the restart, finding the launch's call finished but nothing to load, trained it all
    # again. Now the finished state is published as checkpoint-<max_steps> first: the restart (or
    # `resume_from_checkpoint=True`) loads it and trains no step.
    out = str(tmp_path / "out")
    trainer = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=4, save_strategy="no")
    trainer.add_callback(_SignalAfterLastStep(signal.SIGTERM))
    with pytest.raises(Preempted) as caught:
        trainer.train()
    assert (caught.value.code, caught.value.step) == (PREEMPTED_EXIT_CODE, 4)
    assert sorted(os.listdir(out)).count("checkpoint-4") == 1 and not nonfinite_in_checkpoints(out)
    record = read_progress(out)
    assert (record.phase, record.step, record.history.checkpoints) == ("finished", 4, (4,))
    assert record.history.result["global_step"] == 4
    event = [e for e in read_events(out) if e["kind"] == "preempt"][-1]
    assert (event["step"], event["checkpoint_step"], event["signal"]) == (4, 4, "SIGTERM")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    resumed = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=4, save_strategy="no")
    output = resumed.train(resume_from_checkpoint=True)
    assert output.global_step == 4 and resumed.state.global_step == 4  # nothing trained, no step past the end
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4"]


class _Bounds(TrainerCallback):
    """Records the hang bound each step is timed against, when it begins."""

    def __init__(self, trainer):
        self.trainer, self.seen = trainer, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append(self.trainer.safe_run.watchdog.bound())


def test_each_train_call_learns_its_own_hang_bound(toy_models, tmp_path):
    # A second `train()` call on the same trainer (another stage, other settings) was timed from its first step
    # against the bound learned from the first call's steps (120 s), not against `hang_timeout`.
    trainer = build_trainer("sft", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=4, bf16=False)
    bounds = _Bounds(trainer)
    trainer.add_callback(bounds)
    trainer.train()
    ceiling = trainer.safe_run.watchdog.ceiling
    assert bounds.seen[:3] == [ceiling] * 3 and bounds.seen[3] < ceiling  # learned after steps 2 and 3
    bounds.seen.clear()
    trainer.args.max_steps = 8
    trainer.train()
    assert bounds.seen[:3] == [ceiling] * 3, bounds.seen


def test_the_diagnosis_replay_is_not_timed_as_part_of_the_step(toy_models, tmp_path):
    # The replay that localises a NaN runs every micro-batch of the step again, from inside the step's inspection:
    # timed with the step, a slow replay (a long sequence, a large model) passed the learned bound and the watchdog
    # ended a run that was only diagnosing a skipped step with status 124.
    class Recording(trainer_class("sft")):
        replays: ClassVar[list[bool]] = []

        def compute_loss(self, model, inputs, *args, **kwargs):
            if self.safe_run.hooks.replaying:
                self.replays.append(self.safe_run.watchdog._began is not None)
            return super().compute_loss(model, inputs, *args, **kwargs)

    trainer = build_trainer(
        "sft", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=3, kind="loss")], max_steps=4,
        bf16=False, trainer_cls=Recording,
    )  # fmt: skip
    trainer.train()
    assert any(e["kind"] == "skip" for e in read_events(str(tmp_path)))
    assert trainer.replays and not any(trainer.replays), trainer.replays


@pytest.mark.distributed
def test_sigterm_to_one_rank_during_the_last_step_stops_every_rank_as_preempted(tmp_path):
    # Rank 1 alone gets SIGTERM feeding step 8 of 8: the agreed bit would be read at step 9, which never comes. Rank 1
    # exited 75 and rank 0 returned (status 0), with no `preempt` event: the ranks disagreed on how the run ended.
    # Now they agree once training ended (one collective): both exit 75 with checkpoint-8, and the restart returns
    # the finished state without training a step.
    results, streams = launch_restarting(tmp_path, 2, 1, "--preempt", "8:0:1", "--max_steps", "8")
    for result, stream in zip(results, streams):
        assert steps(stream, "fed") == {0: list(range(1, 9))}  # nothing trained after the restart, no step 9
        assert (result["attempt"], result["global_step"], result["finite"]) == (1, 8, True)
    run = str(tmp_path / "out" / "run")
    events = read_events(run)
    assert [(e["step"], e["kind"]) for e in events] == [(8, "preempt"), (8, "resume")]
    assert (events[0]["ranks"], events[0]["finished"]) == ([1], True)
    assert events[1]["checkpoint"] == os.path.join(run, "checkpoint-8") and events[1]["finished"] == 8


def test_a_signal_to_a_finished_run_resumed_at_its_end_saves_nothing_again(toy_models, tmp_path):
    # A restart (or `resume_from_checkpoint=True`) of a finished run loads its final checkpoint and trains no step; a
    # SIGTERM then exits 75 at once. The final checkpoint is the state it stopped in: it is not written again.
    class Recording(trainer_class("dpo")):
        saves: ClassVar[list[int]] = []

        def _save_checkpoint(self, model, trial):
            self.saves.append(self.state.global_step)
            return super()._save_checkpoint(model, trial)

    class SignalAtBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)

    out = str(tmp_path / "out")
    build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=4).train()
    resumed = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=4, trainer_cls=Recording)
    resumed.add_callback(SignalAtBegin())
    with pytest.raises(Preempted) as caught:
        resumed.train(resume_from_checkpoint=True)
    assert caught.value.step == 4 and resumed.saves == []
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4"]


def test_the_guards_verification_before_a_save_or_evaluation_is_timed(toy_models, tmp_path):
    # Before each save and evaluation every rank verifies the state (a collective), between steps, where the watchdog
    # was not armed: a rank stuck before it (a logger's upload, a callback) left the others waiting in the guard's
    # collective for `ddp_timeout` (30 minutes), undetected. It is now timed against the hang bound, like a step.
    trainer = build_trainer("sft", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=4, bf16=False)
    guard, timed = trainer.nan_guard, []
    check = guard.state_is_finite

    def recording_check():
        timed.append((trainer.state.global_step, trainer.safe_run.watchdog._began is not None))
        return check()

    guard.state_is_finite = recording_check  # this guard instance only: records, then checks as before
    before = guard.judge

    def judge(verify=False, snapshot=False, fresh=False):
        control = trainer.control
        if fresh and (control.should_save or control.should_evaluate):  # the verification before the save
            timed.append("publishing")
        return before(verify=verify, snapshot=snapshot, fresh=fresh)

    guard.judge = judge  # this guard instance only: what runs right before the Trainer saves or evaluates
    trainer.train()
    after = [timed[i + 1] for i, t in enumerate(timed[:-1]) if t == "publishing"]
    assert after and all(was_timed for _, was_timed in after), timed
