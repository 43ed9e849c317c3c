"""`restarts/rotation.py` `rotate_up_to`: `save_total_limit` rotation in an `output_dir` on disk that never deletes
this run's newest checkpoint in favour of higher-numbered ones, and keeps the best model's."""

from __future__ import annotations

import os

from checkpoint_utils import write_checkpoint  # tests/ is on sys.path

from safe_trainers.restarts.rotation import rotate_up_to


def steps_on_disk(run_dir: str) -> list[int]:
    return sorted(int(name.rsplit("-", 1)[1]) for name in os.listdir(run_dir) if name.startswith("checkpoint-"))


def test_an_earlier_runs_higher_checkpoints_are_neither_counted_nor_deleted(tmp_path):
    run = str(tmp_path)
    for step in (8, 12):  # an earlier run's, left in the reused `output_dir`
        write_checkpoint(run, step)
    for step in (0, 2, 4):  # this run's, `checkpoint-4` just published
        write_checkpoint(run, step)
    removed = rotate_up_to(run, 4, 2, None)
    assert removed == [os.path.join(run, "checkpoint-0")]
    assert steps_on_disk(run) == [2, 4, 8, 12]  # this run's newest two; transformers would have kept 8 and 12 only


def test_the_best_models_checkpoint_is_kept(tmp_path):
    run = str(tmp_path)
    for step in (0, 2, 4, 6):
        write_checkpoint(run, step)
    best = os.path.join(run, "checkpoint-0")
    assert rotate_up_to(run, 6, 2, best) == [os.path.join(run, "checkpoint-2"), os.path.join(run, "checkpoint-4")]
    assert steps_on_disk(run) == [0, 6]
    assert rotate_up_to(run, 6, 1, best) == [] and steps_on_disk(run) == [0, 6]  # the newest and the best, at 1


def test_a_best_checkpoint_in_another_directory_protects_nothing_here(tmp_path):
    run = str(tmp_path / "out")
    for step in (2, 4, 6):
        write_checkpoint(run, step)
    elsewhere = write_checkpoint(str(tmp_path / "other"), 2)
    rotate_up_to(run, 6, 1, elsewhere)
    assert steps_on_disk(run) == [6] and os.path.isdir(elsewhere)


def test_no_limit_deletes_nothing(tmp_path):
    run = str(tmp_path)
    for step in (2, 4, 6):
        write_checkpoint(run, step)
    assert rotate_up_to(run, 6, None, None) == [] and rotate_up_to(run, 6, 0, None) == []
    assert steps_on_disk(run) == [2, 4, 6]
