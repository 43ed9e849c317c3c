"""Edges of the guard's bookkeeping: the best model across a rollback, the reference-model sync, saves and evaluations
asked for by a later callback, the replay's metrics, a second `train()` call's learning rate, the event log across a
resume, the fault step across inspection windows, the spike statistics and a user's own loss log (each failed once)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from guard_utils import checkpoint_steps, read_json, weights_finite
from transformers import TrainerCallback

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events
from safe_trainers.guard.policy import StepReading, judge_window


def test_best_model_of_the_snapshot_step_survives_a_rollback(toy_models, tmp_path):
    # Snapshot, evaluation and save all at step 4: the snapshot is taken before step 4's evaluation, yet a rollback
    # to it must keep checkpoint-4 as the best (it holds exactly the restored weights).
    scores = iter([0.5, 0.9])  # eval@4 is the best (lower is better), eval@8 worse

    kwargs = dict(
        eval_rows=4, max_steps=8, eval_strategy="steps", eval_steps=4, save_steps=4, save_total_limit=1,
        load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=False, nan_snapshot_steps=4,
    )  # fmt: skip
    trainer = build_trainer(
        "reward", toy_models["qwen2-rm"], tmp_path, preset="guarded", faults=[Fault(step=5, kind="update")], **kwargs
    )
    trainer.compute_metrics = lambda prediction: {"score": next(scores)}
    trainer.train()
    assert [e["restored_step"] for e in read_events(str(tmp_path)) if e["kind"] == "rollback"] == [4]
    assert trainer.state.best_metric == 0.5 and trainer.state.best_model_checkpoint.endswith("checkpoint-4")
    assert checkpoint_steps(str(tmp_path)) == [4]  # kept as the best (transformers keeps only it at the end)


def test_reference_model_sync_never_mixes_in_a_damaged_policy(toy_models, tmp_path):
    kwargs = dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5, nan_snapshot_steps=2)
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=4, kind="update")], **kwargs
    )
    trainer.train()
    assert [(e["step"], e["kind"]) for e in read_events(str(tmp_path))] == [(4, "rollback")]
    assert all(bool(torch.isfinite(p).all()) for p in trainer.ref_model.parameters())
    assert trainer.state.global_step == 10 and weights_finite(trainer)


class AskForSaveAndEval(TrainerCallback):
    """A user callback (added after the guard's) that asks for a save and an evaluation at step 5."""

    def __init__(self):
        self.on_save_saw = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            control.should_save = control.should_evaluate = True

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.on_save_saw.append((state.global_step, os.path.isdir(path)))


def test_a_late_callbacks_save_and_eval_see_a_verified_state(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        faults=[Fault(step=5, kind="update")],
        eval_rows=4,
        max_steps=8,
        save_strategy="no",
        eval_strategy="steps",
        eval_steps=100,
        nan_snapshot_steps=4,
    )
    callback = AskForSaveAndEval()
    trainer.add_callback(callback)
    trainer.train()
    assert [(e["step"], e["kind"]) for e in read_events(str(tmp_path))] == [(5, "rollback")]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert evals and all(math.isfinite(v) for v in evals)
    assert callback.on_save_saw == [(5, True)]


def test_diagnosis_replay_does_not_count_in_trl_metrics(toy_models, tmp_path):
    def num_tokens(faults, out):
        trainer = build_trainer(
            "dpo",
            toy_models["qwen2"],
            str(out),
            preset="guarded",
            faults=faults,
            gradient_accumulation_steps=2,
            max_steps=4,
        )
        trainer.train()
        return [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]

    clean = num_tokens([], tmp_path / "clean")
    faulted = num_tokens([Fault(step=3, kind="loss", micro_batch=0)], tmp_path / "faulted")
    assert faulted == clean


def test_a_second_train_call_starts_from_the_configured_learning_rate(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=3, kind="update")], max_steps=4
    )
    trainer.train()
    assert trainer.nan_guard.state.lr_scale == 0.5
    trainer.train()  # a new run on the same trainer (no fault this time: the injector's fault has fired)
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs[0] == trainer.args.learning_rate and trainer.nan_guard.state.lr_scale == 1.0


def test_resume_in_the_same_directory_drops_the_abandoned_timelines_events(toy_models, tmp_path):
    faults = [Fault(step=2, kind="loss"), Fault(step=6, kind="loss")]
    build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=faults, max_steps=8).train()
    assert [e["step"] for e in read_events(str(tmp_path))] == [2, 6]
    resumed = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=8)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert [e["step"] for e in read_events(str(tmp_path))] == [2]  # step 6's skip belonged to the abandoned run
    assert read_json(str(tmp_path / "checkpoint-8" / "nan_guard_state.json"))["skipped_steps"] == 1
    assert os.path.exists(tmp_path / "nan_events.previous-1.jsonl")  # the full log is kept


def test_resume_true_without_a_checkpoint_keeps_the_event_log(toy_models, tmp_path):
    build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        faults=[Fault(step=1, kind="loss")],
        max_steps=2,
        save_strategy="no",
    ).train()
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=2, save_strategy="no")
    # Refused before the guard starts a run: the earlier run's log is neither replaced nor moved aside.
    with pytest.raises(ValueError, match=r"`resume_from_checkpoint=True` found no checkpoint to resume from"):
        trainer.train(resume_from_checkpoint=True)
    assert [e["step"] for e in read_events(str(tmp_path))] == [1]
    assert not os.path.exists(tmp_path / "nan_events.previous-1.jsonl")
    assert trainer.state.global_step == 0  # nothing trained


def test_fault_step_counts_back_across_inspection_windows():
    bad = [StepReading(s, math.nan, math.nan, bad=True) for s in (3, 4, 5)]
    first = judge_window(bad[:2], 0, 3, None)
    assert judge_window(bad[2:], first.consecutive, 3, None).fault_step == 3


class _UserLogsALoss(TrainerCallback):
    """A callback that logs its own `loss` key mid-window (at step 3), as a user's code may."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            self.trainer.log({"loss": 123.0, "my_metric": 1.0})


@pytest.mark.parametrize("user_log", [False, True])
def test_a_users_own_loss_log_leaves_the_window_alone(toy_models, tmp_path, user_log):
    # A window of 4 steps with a skipped step 2: only the Trainer's own window log is the ledger's to rewrite (and
    # only it closes the window: in DDP, a log on one rank must not start a collective).
    def window_losses(out, with_user):
        trainer = build_trainer(
            "dpo", toy_models["qwen2"], out, preset="guarded", faults=[Fault(step=2, kind="loss")], max_steps=4,
            logging_steps=4, save_steps=100,
        )  # fmt: skip
        if with_user:
            trainer.add_callback(_UserLogsALoss(trainer))
        trainer.train()
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    reference = window_losses(tmp_path / "a", False)
    logged = window_losses(tmp_path / "b", user_log)
    assert math.isclose(logged[4], reference[4], rel_tol=1e-6) and math.isfinite(logged[4])
    if user_log:
        assert logged[3] == 123.0  # the user's value, as logged
