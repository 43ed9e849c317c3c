"""Defects found in review of `safe-trainers timeline` (branch h-timeline): each test reproduces one."""

from __future__ import annotations

import json
import os

from safe_trainers.restarts.progress import History, Progress, ProgressWriter
from safe_trainers.timeline import read_run
from safe_trainers.timeline.goodput import ProcessSpan, goodput, process_spans


def test_a_resume_before_an_earlier_resume_point_counts_every_redone_step():
    # Process 0 ran steps 1-57 (1 s each) and died; process 1 resumed at checkpoint-50, ran 51-53 and died;
    # checkpoint-50 was then passed over and process 2 resumed at checkpoint-40 and finished at 100. Only steps 1-40
    # of process 0 are in the final weights: 100 productive steps, 17 + 3 redone.
    spans = [
        ProcessSpan(0, 0.0, 60.0, 0, 57, 57.0),
        ProcessSpan(1, 70.0, 75.0, 50, 53, 3.0),
        ProcessSpan(2, 80.0, 150.0, 40, 100, 60.0, finished=True),
    ]
    found = goodput(spans, [])
    assert (found.productive, found.redone_steps) == (100.0, 20)


def test_a_record_compiling_a_step_has_not_finished_that_step():
    # `compile` is written inside a step (torch compiling it), as `step` is: `inherit` counts it so, the span of the
    # process still running must too.
    history = History(1, began=1000.0, first_step=4)
    compiling = Progress(9, "compile", "d", history, time=1050.0, step_seconds=40.0)
    assert process_spans(compiling)[0].last_step == 8


def test_a_run_without_the_guard_before_its_first_log_is_read(tmp_path):
    # nan_guard=False (no event log, no step record), checkpoint-4 saved before the first log (logging_steps=10):
    # the run has a checkpoint and a trainer_state.json, the command must not say it has neither.
    os.makedirs(tmp_path / "checkpoint-4")
    with open(tmp_path / "checkpoint-4" / "trainer_state.json", "w") as f:
        json.dump({"global_step": 4, "max_steps": 20, "log_history": []}, f)
    run = read_run(str(tmp_path))
    assert run.last_step == 0 and run.record is None


def test_the_metrics_are_this_runs_not_those_of_an_earlier_runs_checkpoint(tmp_path):
    # An earlier run left checkpoint-100 in output_dir; this run (a new one, its record lists its own checkpoints)
    # is at step 20 with checkpoint-20. The timeline must draw this run's log history, not the earlier run's.
    for step, loss in ((100, 9.0), (20, 1.0)):
        os.makedirs(tmp_path / f"checkpoint-{step}")
        with open(tmp_path / f"checkpoint-{step}" / "trainer_state.json", "w") as f:
            json.dump({"global_step": step, "log_history": [{"step": step, "loss": loss}]}, f)
    writer = ProgressWriter(str(tmp_path), History(0, checkpoints=(20,), began=1000.0), "d")
    writer.write(20, "between", 1100.0, 90.0)
    writer.close()
    run = read_run(str(tmp_path))
    assert run.log_source == str(tmp_path / "checkpoint-20" / "trainer_state.json")
