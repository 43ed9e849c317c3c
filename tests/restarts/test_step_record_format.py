"""The step record's file format: records written by earlier runs (and earlier versions) still load.

A restarted process reads the record its predecessor left in `output_dir`; the predecessor may have run an earlier
version of the package. The literal below is what the writer wrote when the format was pinned: it must neither change
nor stop loading.
"""

from __future__ import annotations

import os
from dataclasses import replace

from safe_trainers.restarts.progress import (
    PROGRESS_FILE, Death, History, Poisoned, Progress, ProgressWriter, Span, read_progress,
)  # fmt: skip

DATA = "world=1 batch=2 accumulation=1 seed=42 data_seed=None rows=64"
AGENT = "none@host:/tmp/torchelastic_a/none_b"
RESULT = {"global_step": 8, "training_loss": 0.5, "metrics": {"train_loss": 0.5}}
SPAN = Span(attempt=2, began=1795899000.5, ended=1795899100.25, first_step=4, last_step=9, step_seconds=80.125)
HISTORY = History(
    3, deaths=(Death(1, 7), Death(2, None)), poisoned=(Poisoned(7, (0, 1)),), launch=(AGENT,), restart=2, stage=1,
    origin="out/checkpoint-2", checkpoints=(4, 8), result=RESULT, began=1795899200.5, first_step=8, spans=(SPAN,),
)  # fmt: skip
RECORD = (
    '{"attempt": 3, "step": 9, "phase": "step", "time": 1795899300.125, "step_seconds": 12.5, "data": "' + DATA + '", '
    '"deaths": [{"attempt": 1, "step": 7}, {"attempt": 2, "step": null}], '
    '"poisoned": [{"step": 7, "attempts": [0, 1]}], '
    '"launch": ["' + AGENT + '"], "restart": 2, "stage": 1, "origin": "out/checkpoint-2", "checkpoints": [4, 8], '
    '"result": {"global_step": 8, "training_loss": 0.5, "metrics": {"train_loss": 0.5}}, "began": 1795899200.5, '
    '"first_step": 8, "spans": [{"attempt": 2, "began": 1795899000.5, "ended": 1795899100.25, "first_step": 4, '
    '"last_step": 9, "step_seconds": 80.125, "finished": false}]}'
)
# The format before the wall-time stamps and spans (what a restarted process may find, written by an older version).
RECORD_BEFORE_SPANS = (
    '{"attempt": 3, "step": 9, "phase": "step", "data": "' + DATA + '", "deaths": [{"attempt": 1, "step": 7}, '
    '{"attempt": 2, "step": null}], "poisoned": [{"step": 7, "attempts": [0, 1]}], "launch": ["' + AGENT + '"], '
    '"restart": 2, "stage": 1, "origin": "out/checkpoint-2", "checkpoints": [4, 8], "result": {"global_step": 8, '
    '"training_loss": 0.5, "metrics": {"train_loss": 0.5}}}'
)


def _write(directory, text: str) -> None:
    with open(os.path.join(directory, PROGRESS_FILE), "w") as f:
        f.write(text)


def test_the_writer_writes_the_pinned_format(tmp_path):
    writer = ProgressWriter(str(tmp_path), HISTORY, DATA)
    writer.write(9, "step", 1795899300.125, 12.5)
    writer.close()
    with open(tmp_path / PROGRESS_FILE) as f:
        assert f.read() == RECORD


def test_a_record_in_the_pinned_format_loads(tmp_path):
    _write(tmp_path, RECORD)
    record = read_progress(str(tmp_path))
    assert record == Progress(9, "step", DATA, HISTORY) and (record.time, record.step_seconds) == (1795899300.125, 12.5)


def test_a_record_before_the_wall_time_stamps_loads(tmp_path):
    _write(tmp_path, RECORD_BEFORE_SPANS)
    before = replace(HISTORY, began=None, first_step=0, spans=())
    record = read_progress(str(tmp_path))
    assert record == Progress(9, "step", DATA, before) and (record.time, record.step_seconds) == (0.0, 0.0)


def test_a_record_of_an_older_version_loads(tmp_path):
    # Before stages, origins, published checkpoints and results; `launch` was one string; unknown keys are ignored.
    older = '{"attempt": 1, "step": 7, "phase": "between", "data": "d", "deaths": [], "launch": "a", "gone": 1}'
    _write(tmp_path, older)
    assert read_progress(str(tmp_path)) == Progress(7, "between", "d", History(1, launch=("a",)))


def test_a_record_that_is_not_one_reads_as_none(tmp_path):
    assert read_progress(str(tmp_path)) is None  # no file
    # no attempt, cut short, JSON but not an object, a field of the wrong shape
    for text in ['{"step": 7, "phase": "step", "data": "d"}', '{"attempt": 1, "step": 7', "[]", "null", "7",
                 '{"attempt": 1, "step": 7, "phase": "step", "data": "d", "deaths": [7]}']:
        _write(tmp_path, text)
        assert read_progress(str(tmp_path)) is None, text


def test_a_new_process_keeps_the_span_of_the_one_before(tmp_path):
    # What the timeline's goodput and restart gaps are computed from: the previous process's start, its last write
    # (close to its death), the steps it ran and its time inside steps.
    from safe_trainers.restarts.progress import inherit

    writer = ProgressWriter(str(tmp_path), replace(HISTORY, result=None), DATA)
    writer.write(9, "step", 1795899300.125, 12.5)
    writer.close()
    history = inherit(read_progress(str(tmp_path)), continuing=True, data=DATA, skip_after=0)
    assert history.spans == (SPAN, Span(3, 1795899200.5, 1795899300.125, 8, 8, 12.5))  # died inside step 9
    assert (history.attempt, history.began, history.first_step) == (4, None, 0)  # set when the new process starts
