"""`restarts/resume_plan.py`: `resolve_run` (where `train()` starts, planned and handed to every rank) and
`record_resume` (the `resume` event), in a single process with no process group, over checkpoints written to disk."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from checkpoint_utils import write_checkpoint  # tests/ is on sys.path

from safe_trainers.restarts.agents import ERROR_FILE, MAX_RESTARTS, RESTART_COUNT, RUN_ID
from safe_trainers.restarts.resume_plan import record_resume, resolve_run
from safe_trainers.runtime.events import EventLog, read_events


@pytest.fixture(autouse=True)
def no_elastic_agent(monkeypatch):
    """A plain `python` process, whatever launched the tests."""
    for name in (RESTART_COUNT, RUN_ID, ERROR_FILE, MAX_RESTARTS):
        monkeypatch.delenv(name, raising=False)


def args_for(output_dir) -> SimpleNamespace:
    """The config fields `resolve_run` reads (the output directory, the rank, what identifies the data order)."""
    return SimpleNamespace(
        output_dir=str(output_dir), process_index=0, world_size=1, per_device_train_batch_size=2,
        gradient_accumulation_steps=1, seed=42, data_seed=None,
    )  # fmt: skip


def resolve_and_record(output_dir, requested):
    """`resolve_run` then `record_resume`, as a guarded `train()` does; returns the plan and the events written (an
    event's detail is flattened into its line)."""
    plan = resolve_run(args_for(output_dir), None, 16, requested)
    events = EventLog(str(output_dir), write=True)
    record_resume(events, plan)
    return plan, read_events(str(output_dir))


@pytest.mark.parametrize("requested", [None, False])
def test_a_new_run_starts_from_scratch_and_records_no_resume(tmp_path, requested):
    write_checkpoint(str(tmp_path), 4)  # an earlier run's: not resumed from unless asked
    plan, events = resolve_and_record(tmp_path, requested)
    assert (plan.checkpoint, plan.reason, plan.restart, plan.finished) == (None, "new", 0, False)
    assert events == [] and not dist.is_initialized()  # planned and "broadcast" with no process group


def test_true_resumes_from_the_newest_healthy_checkpoint_and_records_what_it_passed_over(tmp_path):
    run = str(tmp_path)
    good = write_checkpoint(run, 4)
    write_checkpoint(run, 6, weight=float("nan"))
    plan, events = resolve_and_record(tmp_path, True)
    assert (plan.checkpoint, plan.reason) == (good, "requested")
    assert [os.path.basename(p.path) for p in plan.passed_over] == ["checkpoint-6"]
    (event,) = events
    assert (event["step"], event["kind"], event["checkpoint"], event["reason"]) == (
        4, "resume", good, "requested",
    )  # fmt: skip
    assert event["passed_over"] == [
        {"checkpoint": os.path.join(run, "checkpoint-6"), "reason": "non-finite: `w` in `model.safetensors`"}
    ]


def test_true_with_no_usable_checkpoint_raises_naming_each_one_passed_over(tmp_path):
    write_checkpoint(str(tmp_path), 6, weight=float("nan"))
    with pytest.raises(ValueError, match=r"found no checkpoint to resume from: every .*\(`checkpoint-6`: non-finite"):
        resolve_run(args_for(tmp_path), None, 16, True)
    with pytest.raises(ValueError, match=r"holds no `checkpoint-N` directory"):
        resolve_run(args_for(tmp_path / "empty"), None, 16, True)


def test_an_explicit_path_is_the_users_choice_taken_as_given(tmp_path):
    chosen = write_checkpoint(str(tmp_path), 2, weight=float("nan"))  # not checked for finiteness
    write_checkpoint(str(tmp_path), 4)
    plan, events = resolve_and_record(tmp_path, chosen)
    assert (plan.checkpoint, plan.reason, plan.passed_over) == (chosen, "explicit", ())
    assert events == []  # a clean run resumed from a path: nothing to report


def test_a_restart_without_a_record_of_its_launch_starts_over_and_is_recorded(tmp_path, monkeypatch):
    write_checkpoint(str(tmp_path), 4)  # not this launch's: never resumed from by a restart
    monkeypatch.setenv(RESTART_COUNT, "1")
    monkeypatch.setenv(RUN_ID, "job")
    monkeypatch.setenv(ERROR_FILE, str(tmp_path / "agent" / "attempt_1" / "0" / "error.json"))
    plan, events = resolve_and_record(tmp_path, None)
    assert (plan.checkpoint, plan.reason, plan.restart) == (None, "restart", 1)
    (event,) = events
    assert (event["step"], event["kind"], event["reason"], event["restart"]) == (
        0, "resume", "restart", 1,
    )  # fmt: skip
