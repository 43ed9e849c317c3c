"""The timeline on the runs that are easy to get wrong: a later process resuming before an earlier resume point, a
record written while compiling, a run without the guard or its step record, an earlier run's checkpoints in
`output_dir`, a hang a resume cut from the event log, a finished call re-entered, a newer record, a renamed
checkpoint."""

from __future__ import annotations

import json
import os

from safe_trainers.restarts.progress import History, Progress, ProgressWriter, Span
from safe_trainers.timeline import read_run
from safe_trainers.timeline.goodput import goodput, process_spans


def test_a_resume_before_an_earlier_resume_point_counts_every_redone_step():
    # Process 0 ran steps 1-57 (1 s each) and died; process 1 resumed at checkpoint-50, ran 51-53 and died;
    # checkpoint-50 was then passed over and process 2 resumed at checkpoint-40 and finished at 100. Only steps 1-40
    # of process 0 are in the final weights: 100 productive steps, 17 + 3 redone.
    spans = [
        Span(0, 0.0, 60.0, 0, 57, 57.0),
        Span(1, 70.0, 75.0, 50, 53, 3.0),
        Span(2, 80.0, 150.0, 40, 100, 60.0, finished=True),
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


def test_a_hang_that_restarted_the_run_keeps_its_marker(tmp_path):
    # As in tests/restarts/test_preemption_and_hangs.py::test_a_rank_that_hangs_is_detected_and_a_step_that_hangs_
    # twice_is_skipped: the watchdog records the hang at step 6 and the process exits; the agent restarts it from
    # checkpoint-4, and the new process's event log keeps only the events up to step 4. The timeline must still mark
    # the hang (the requirement: a marker at each hang).
    from safe_trainers.runtime.events import EventLog, RunEvent
    from safe_trainers.timeline import markers

    import time

    # The step record of the restarted process: the run began (its first process) before the hang.
    writer = ProgressWriter(str(tmp_path), History(1, began=time.time() - 60, first_step=4), "d")
    writer.write(5, "step", time.time(), 1.0)
    writer.close()
    first = EventLog(str(tmp_path), write=True)
    first.start_run(None)
    first.add(RunEvent(6, "hang", [], [1], {"seconds": 10.5, "exited": True}))
    second = EventLog(str(tmp_path), write=True)
    second.start_run(4)
    second.add(RunEvent(4, "resume", [], [], {"checkpoint": "checkpoint-4", "restart": 1, "deaths": []}))
    shown = {(m.kind, m.step) for m in markers(read_run(str(tmp_path)).events)}
    assert ("hang", 6) in shown, shown


def test_a_finished_call_reentered_after_a_restart_keeps_its_goodput():
    # A script's first `train()` call (output_dir A) finished at step 100 after 100 s (90 s in steps); its second
    # call (output_dir B) ran 3600 s and died; torchrun restarted the script, whose first call trains no step (it had
    # finished) and returns at once. A's goodput is that of the 100 s it trained, not diluted by B's hour.
    from safe_trainers.restarts.progress import inherit

    done = Progress(100, "finished", "d", History(0, began=1000.0, result={"global_step": 100}), 1100.0, 90.0)
    history = inherit(done, continuing=True, data="d", skip_after=2)
    reentered = Progress(100, "finished", "d", History(1, began=4700.0, first_step=100, spans=history.spans,
                                                       result={"global_step": 100}), 4701.0, 0.0)  # fmt: skip
    assert goodput(process_spans(reentered), []).ratio == 0.9


def test_a_record_whose_spans_a_newer_version_extended_still_loads(tmp_path):
    # Forward compatibility: unknown top-level fields of a newer record are ignored (`from_json` keeps the known
    # ones), but one more field in a span makes the whole record unreadable, and a restart then starts over from
    # step 0 (no record: not this launch's).
    from safe_trainers.restarts.progress import PROGRESS_FILE, read_progress

    span = ('{"attempt": 0, "began": 1000.0, "ended": 1080.0, "first_step": 0, "last_step": 7, "step_seconds": 70.0, '
            '"finished": false}')  # fmt: skip
    text = ('{"attempt": 1, "step": 9, "phase": "step", "time": 1150.0, "step_seconds": 40.0, "data": "d", '
            '"began": 1100.0, "first_step": 4, "spans": [' + span + '], "a_newer_field": 1}')  # fmt: skip
    with open(tmp_path / PROGRESS_FILE, "w") as f:
        f.write(text)
    assert read_progress(str(tmp_path)) is not None


def test_a_resume_from_a_checkpoint_not_named_checkpoint_n_records_the_step_it_resumed_at(toy_models, tmp_path):
    # `resume_from_checkpoint="/somewhere/kept"` (a copied or renamed checkpoint of step 2): the process resumes at
    # step 2, but its span says it began at step 0, so the timeline counts every step of the earlier process redone.
    import shutil

    from safe_trainers.restarts.progress import read_progress
    from safe_trainers.testing.build import build_trainer

    out = tmp_path / "run"
    build_trainer("sft", toy_models["qwen2"], str(out), preset="guarded", max_steps=4, save_steps=2, rows=48).train()
    shutil.copytree(out / "checkpoint-2", tmp_path / "kept")
    again = build_trainer("sft", toy_models["qwen2"], str(out), preset="guarded", max_steps=6, save_steps=2, rows=48)
    again.train(resume_from_checkpoint=str(tmp_path / "kept"))
    spans = process_spans(read_progress(str(out)))
    assert [(s.first_step, s.last_step) for s in spans] == [(0, 4), (2, 6)]
    assert goodput(spans, []).redone_steps == 2


def test_a_run_without_a_step_record_is_not_said_to_have_one_of_an_older_version(tmp_path):
    # nan_guard=False writes no step record: the summary's time line must not say the run has an older one, and
    # should name the setting that records the wall times.
    from safe_trainers.timeline import summary

    os.makedirs(tmp_path / "checkpoint-4")
    with open(tmp_path / "checkpoint-4" / "trainer_state.json", "w") as f:
        json.dump({"global_step": 4, "log_history": [{"step": 2, "loss": 1.0}]}, f)
    time_line = [line for line in summary(read_run(str(tmp_path))).splitlines() if "time:" in line][0]
    assert "older version" not in time_line or "nan_guard" in time_line, time_line
