"""The step record's file format: records written by earlier runs (and earlier versions) still load.

A restarted process reads the record its predecessor left in `output_dir`; the predecessor may have run an earlier
version of the package. The literal below is what the writer wrote when the format was pinned: it must neither change
nor stop loading.
"""

from __future__ import annotations

import os

from safe_trainers.restarts.progress import (
    PROGRESS_FILE, Death, History, Poisoned, Progress, ProgressWriter, read_progress,
)  # fmt: skip

DATA = "world=1 batch=2 accumulation=1 seed=42 data_seed=None rows=64"
AGENT = "none@host:/tmp/torchelastic_a/none_b"
RESULT = {"global_step": 8, "training_loss": 0.5, "metrics": {"train_loss": 0.5}}
HISTORY = History(
    3, deaths=(Death(1, 7), Death(2, None)), poisoned=(Poisoned(7, (0, 1)),), launch=(AGENT,), restart=2, stage=1,
    origin="out/checkpoint-2", checkpoints=(4, 8), result=RESULT,
)  # fmt: skip
RECORD = (
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
    writer.write(9, "step")
    writer.close()
    with open(tmp_path / PROGRESS_FILE) as f:
        assert f.read() == RECORD


def test_a_record_in_the_pinned_format_loads(tmp_path):
    _write(tmp_path, RECORD)
    assert read_progress(str(tmp_path)) == Progress(9, "step", DATA, HISTORY)


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
