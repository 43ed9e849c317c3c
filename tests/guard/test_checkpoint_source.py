"""`guard/rollback/checkpoint.py` `CheckpointSource`: the last good state kept on disk (`nan_rollback_from=
"checkpoint"`). Which checkpoint a rollback loads, what stops the run when none is left, and what a restore takes
from the checkpoint's `trainer_state.json`, over checkpoints written to disk (no trainer); and the guard handing the
choice back as its decision."""

from __future__ import annotations

import os

import pytest
import torch
from checkpoint_utils import write_checkpoint  # tests/ is on sys.path
from loop_utils import Loop
from transformers import TrainerState

from safe_trainers.errors import TrainingDivergedError
from safe_trainers.guard import Backend
from safe_trainers.guard.rollback.checkpoint import CheckpointSource
from safe_trainers.runtime.events import EventLog, read_events


def source_over(run_dir: str, resumed_from: str | None = None) -> CheckpointSource:
    model = torch.nn.Linear(2, 2)
    backend = Backend(torch.optim.SGD(model.parameters(), lr=0.1), None, False)
    return CheckpointSource(model, backend, EventLog(run_dir, write=True), run_dir, resumed_from)


def test_to_load_is_the_newest_good_checkpoint_at_or_before_the_step(tmp_path):
    run = str(tmp_path)
    resumed = write_checkpoint(run, 2)
    source = source_over(run, resumed_from=resumed)
    for step in (4, 8):
        source.published(write_checkpoint(run, step))
    assert source.to_load(3) == resumed  # the checkpoint the run resumed from is a good state
    assert source.to_load(6) == os.path.join(run, "checkpoint-4")
    assert source.to_load(8) == os.path.join(run, "checkpoint-8")


def test_an_earlier_runs_checkpoint_is_never_loaded_and_a_rotated_one_is_passed_by(tmp_path):
    run = str(tmp_path)
    source = source_over(run)
    source.published(write_checkpoint(run, 2))
    source.published(write_checkpoint(run, 4))
    write_checkpoint(run, 5)  # on disk, not published by this run
    assert source.to_load(6) == os.path.join(run, "checkpoint-4")
    os.rename(os.path.join(run, "checkpoint-4"), os.path.join(run, "rotated"))  # gone from its place
    assert source.to_load(6) == os.path.join(run, "checkpoint-2")


def test_no_good_state_left_stops_the_run_with_an_abort_event(tmp_path):
    run = str(tmp_path)
    source = source_over(run, resumed_from=str(tmp_path / "checkpoint-3"))  # named, but not on disk: not good
    write_checkpoint(run, 1)  # an earlier run's
    source.published(write_checkpoint(run, 7))  # after the step that failed
    with pytest.raises(TrainingDivergedError, match=r"at step 5 .* no good state to roll back to") as raised:
        source.to_load(5)
    assert raised.value.checkpoint_dir is None and run in str(raised.value)  # where it looked, named
    (event,) = read_events(run)
    assert (event["step"], event["kind"], event["nonfinite"]) == (5, "abort", ["weights_or_optimizer_state"])
    assert event["reason"] == "no_good_state" and event["good"] == [os.path.join(run, "checkpoint-7")]


def test_a_first_good_state_needs_a_checkpoint_until_one_is_published(tmp_path):
    run = str(tmp_path)
    source = source_over(run)
    assert source.needs_checkpoint(0)
    source.take(TrainerState(global_step=0))
    source.published(write_checkpoint(run, 0))
    assert not source.needs_checkpoint(0) and not source.needs_checkpoint(6)
    assert not source_over(run, resumed_from=write_checkpoint(run, 4)).needs_checkpoint(4)  # resumed: it has one


def test_restore_takes_the_best_model_fields_of_the_checkpoint_loaded(tmp_path):
    run = str(tmp_path)
    source = source_over(run)
    best = os.path.join(run, "checkpoint-2")
    source.published(write_checkpoint(run, 2, best_metric=0.7, best_global_step=2, best_model_checkpoint=best))
    source.published(write_checkpoint(run, 4, best_metric=0.5, best_global_step=2, best_model_checkpoint=best))
    # The discarded timeline found a better model at step 6; the rollback at step 7 goes back to checkpoint-4.
    state = TrainerState(global_step=7, best_metric=0.1, best_global_step=6)
    state.best_model_checkpoint = os.path.join(run, "checkpoint-6")
    snapshot = source.restore(state)
    assert snapshot.step == 4 and state.global_step == 7  # the timeline goes on
    assert (state.best_metric, state.best_global_step, state.best_model_checkpoint) == (0.5, 2, best)
    source.published(write_checkpoint(run, 6))  # written without best-model fields: none after a restore to it
    source.restore(state)
    assert (state.best_metric, state.best_global_step, state.best_model_checkpoint) == (None, None, None)


def test_the_guard_hands_the_checkpoint_to_load_back_as_its_decision(tmp_path):
    """With the disk source `begin` asks the caller to publish a starting checkpoint, and a rollback decision names
    the checkpoint the caller loads before `restore` (the load itself is the integration layer's)."""
    loop = Loop(tmp_path, faults={3: "update"})
    assert loop.begin(rollback_from="checkpoint") is True
    loop.guard.published(write_checkpoint(str(tmp_path), 0))
    loop.step(), loop.step(), loop.step()
    decision = loop.guard.settle(loop.guard.judge(verify=True))
    assert decision.restore and decision.load == os.path.join(str(tmp_path), "checkpoint-0")
