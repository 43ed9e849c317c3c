"""`EventLog` (`runtime/events.py`): a new run keeps the previous log aside, a resumed run keeps the events of its own
timeline only, non-main processes write nothing, and NaN values are written as JSON strings."""

from __future__ import annotations

import json
import math

from safe_trainers.runtime.events import EVENTS_FILE, EventLog, RunEvent, read_events


def write(tmp_path, steps: list[int]) -> EventLog:
    log = EventLog(str(tmp_path), write=True)
    log.start_run(resumed_at=None)
    for s in steps:
        log.add(RunEvent(s, "skip", ["loss"], [0], {"loss": math.nan}))
    return log


def test_events_are_appended_one_json_object_a_line_with_nan_as_a_string(tmp_path):
    log = write(tmp_path, [2, 5])
    assert [e.step for e in log.events] == [2, 5]
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 5]
    first = read_events(str(tmp_path))[0]
    assert (first["kind"], first["loss"], first["nonfinite"], first["ranks"]) == ("skip", "nan", ["loss"], [0])


def test_a_new_run_keeps_the_previous_log_aside_and_starts_empty(tmp_path):
    write(tmp_path, [2])
    log = EventLog(str(tmp_path), write=True)
    assert log.start_run(resumed_at=None) == str(tmp_path / "nan_events.previous-1.jsonl")
    assert read_events(str(tmp_path)) == [] and log.events == []
    write(tmp_path, [3])  # nothing was logged since: nothing to keep aside
    assert not (tmp_path / "nan_events.previous-2.jsonl").exists()
    write(tmp_path, [4])  # the next run keeps step 3's log, numbered on
    assert (tmp_path / "nan_events.previous-2.jsonl").read_text().count('"step": 3') == 1


def test_a_resumed_run_keeps_only_the_events_of_its_own_timeline(tmp_path):
    write(tmp_path, [2, 6, 9])
    log = EventLog(str(tmp_path), write=True)
    kept = log.start_run(resumed_at=4)  # resumed from checkpoint-4: steps 6 and 9 belong to the abandoned timeline
    assert [e["step"] for e in read_events(str(tmp_path))] == [2]
    assert kept is not None and len((tmp_path / "nan_events.previous-1.jsonl").read_text().splitlines()) == 3
    # Resumed at or after every event: the log goes on as it is, nothing is moved aside.
    assert EventLog(str(tmp_path), write=True).start_run(resumed_at=10) is None
    assert not (tmp_path / "nan_events.previous-2.jsonl").exists()


def test_a_process_that_does_not_write_leaves_the_files_alone(tmp_path):
    write(tmp_path, [1])
    log = EventLog(str(tmp_path), write=False)
    assert log.start_run(resumed_at=None) is None
    log.add(RunEvent(3, "skip"))
    assert [e["step"] for e in read_events(str(tmp_path))] == [1] and [e.step for e in log.events] == [3]
