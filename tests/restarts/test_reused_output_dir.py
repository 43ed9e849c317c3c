"""Restarts in one `output_dir` reused across runs, and deaths outside a step.

Each test writes the record a killed process leaves (`ProgressWriter`) and sets the elastic agent's restart count, as
torchrun does for a restarted worker; the end-to-end restarts under torchrun are in `test_crash_restarts.py`.
"""

from __future__ import annotations

import os

import pytest
from guard_utils import recording
from transformers import TrainerCallback

from safe_trainers.guard import read_events
from safe_trainers.restarts.progress import Death, History, ProgressWriter, data_identity, read_progress
from safe_trainers.restarts.agents import TrainCalls, agent_identity, launch_agents
from safe_trainers.restarts.resume_plan import NOT_THIS_LAUNCHS
from safe_trainers.trainer.run import can_leave_out_a_step
from safe_trainers.testing.build import build_trainer
from safe_trainers.trainers import trainer_class


def died(trainer, attempt: int, step: int, deaths=(), launch: tuple[str, ...] = (), restart: int = 0) -> None:
    """The record a process of the run leaves when it is killed inside `step` (at the agent's restart count
    `restart`)."""
    data = data_identity(trainer.args, len(trainer.train_dataset))
    history = History(attempt, deaths=tuple(deaths), launch=launch, restart=restart)
    writer = ProgressWriter(trainer.args.output_dir, history, data)
    writer.write(step, "step")
    writer.close()


def restarted(monkeypatch, count: int) -> tuple[str, ...]:
    """The environment torchrun's agent gives its workers at restart `count`; the agents of this launch. A new process
    counts its `train()` calls afresh."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", f"/tmp/torchelastic_t/none_t/attempt_{count}/0/error.json")
    TrainCalls.reset()
    return launch_agents([agent_identity(os.environ)])


def test_a_restart_never_adopts_an_earlier_runs_checkpoint(toy_models, tmp_path, monkeypatch):
    # Run A finished in this output_dir (checkpoints 4, 8, 10). Run B, restarted after a death at step 3 (before its
    # first save), must start over rather than resume from A's checkpoint-10 and return A's model.
    build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", learning_rate=5e-2).train()
    cls = recording(trainer_class("dpo"))
    b = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", trainer_cls=cls)
    died(b, attempt=0, step=3, launch=restarted(monkeypatch, 1))
    b.train()
    resume = [e for e in read_events(str(tmp_path)) if e["kind"] == "resume"][-1]
    assert resume["checkpoint"] is None and [p["reason"] for p in resume["passed_over"]] == [NOT_THIS_LAUNCHS] * 3
    assert [s[0] for s in b.seen] == list(range(1, 11))  # all ten steps trained


def test_an_earlier_runs_record_neither_poisons_nor_resumes(toy_models, tmp_path, monkeypatch):
    # Run A's processes died twice at step 3 and left their record. Run B dies before `train()` (loading, NCCL
    # init) and is restarted: the record is another launch's, so step 3's batches, which never killed B, train.
    b = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", save_strategy="no")
    died(b, attempt=1, step=3, deaths=[Death(0, 3)], launch=("none@another-host:/tmp/torchelastic_o/none_o",))
    restarted(monkeypatch, 1)
    b.train()
    assert [e for e in read_events(str(tmp_path)) if e["kind"] == "poison"] == []
    assert b.nan_guard.state.skipped_steps == 0


class _DiesAtStart(TrainerCallback):
    """A process killed before its first step (loading, wrapping the model, the first snapshot)."""

    def on_train_begin(self, args, state, control, **kwargs):
        raise SystemExit("killed during start-up")


def test_a_death_during_start_up_keeps_the_runs_history(toy_models, tmp_path, monkeypatch):
    # Attempts 0 and 1 died feeding step 3; attempt 2 dies before its first step. Attempt 3 still knows the run's
    # history (and skips step 3), and attempt 2's death is not blamed on any step's data.
    kw = dict(preset="guarded", save_strategy="no")
    third = build_trainer("dpo", toy_models["qwen2"], tmp_path, **kw)
    died(third, attempt=1, step=3, deaths=[Death(0, 3)], launch=restarted(monkeypatch, 2), restart=1)
    third.add_callback(_DiesAtStart())
    with pytest.raises(SystemExit):
        third.train()
    record = read_progress(str(tmp_path))
    assert (record.history.attempt, record.phase) == (2, "between")
    fourth = build_trainer("dpo", toy_models["qwen2"], tmp_path, **kw)
    restarted(monkeypatch, 3)
    fourth.train()
    assert [e["step"] for e in read_events(str(tmp_path)) if e["kind"] == "poison"] == [3]
    assert read_events(str(tmp_path))[0]["deaths"] == [
        {"attempt": 0, "step": 3}, {"attempt": 1, "step": 3}, {"attempt": 2, "step": None}
    ]


@pytest.mark.parametrize("overrides,possible", [({}, True), ({"steps_per_generation": 2}, False)])
def test_grpo_leaves_a_step_out_only_when_its_generation_buffer_allows(toy_models, tmp_path, overrides, possible):
    # TRL indexes the completions buffered for several optimizer steps by the steps it trained: leaving one out
    # would shift every later step onto the wrong completions, so the poisoned step is reported and trained.
    trainer = build_trainer("grpo", toy_models["qwen2"], tmp_path, preset="guarded", **overrides)
    assert can_leave_out_a_step(trainer) is possible


def test_a_finished_call_with_no_checkpoint_trains_again_to_the_same_end(toy_models, tmp_path, monkeypatch):
    # `save_strategy="no"`: the finished call left no checkpoint to load its final state from. Restarted after it
    # returned, it trains again from the start, to `max_steps` and not past it, and returns what it returned before.
    kw = dict(preset="guarded", save_strategy="no", max_steps=4)
    restarted(monkeypatch, 0)
    first = build_trainer("dpo", toy_models["qwen2"], tmp_path, **kw).train()
    restarted(monkeypatch, 1)
    again = build_trainer("dpo", toy_models["qwen2"], tmp_path, trainer_cls=recording(trainer_class("dpo")), **kw)
    output = again.train()
    assert output == first and [s for s, _ in again.seen] == [1, 2, 3, 4]
    assert read_progress(str(tmp_path)).history.result["metrics"] == first.metrics


def test_two_train_calls_sharing_an_output_dir_are_refused_at_restart(toy_models, tmp_path, monkeypatch):
    # Two `train()` calls of one script in one `output_dir`: the second's checkpoints replace the first's, so a
    # restart cannot bring back the first call's final state. It says so rather than resume the wrong checkpoints.
    kw = dict(preset="guarded", save_strategy="no", max_steps=2)
    restarted(monkeypatch, 0)
    for _ in range(2):
        build_trainer("dpo", toy_models["qwen2"], tmp_path, **kw).train()
    restarted(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"call #1 with `output_dir=.*` had finished .* call #2 of the same launch"):
        build_trainer("dpo", toy_models["qwen2"], tmp_path, **kw).train()
