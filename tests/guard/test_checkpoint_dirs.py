"""`guard/checkpoint_dirs.py`: checkpoint names with transformers' prefix, and write-then-rename publishing through
the staging directory."""

from __future__ import annotations

import os

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from safe_trainers.guard.checkpoint_dirs import (
    STAGING_DIR,
    checkpoint_dir,
    checkpoint_step,
    checkpoints,
    clean_staging,
    publish,
    staging_run_dir,
)  # fmt: skip


def test_names_are_transformers_own_and_read_back_to_their_step(tmp_path):
    path = checkpoint_dir(str(tmp_path), 12)
    assert os.path.basename(path) == f"{PREFIX_CHECKPOINT_DIR}-12"
    assert checkpoint_step(path) == 12 and checkpoint_step(path + "/") == 12
    assert checkpoint_step(str(tmp_path / "checkpoint-best")) is None and checkpoint_step("checkpoint-12-tmp") is None


def test_checkpoints_are_listed_by_step_not_by_name(tmp_path):
    for step in (10, 9, 100):
        os.makedirs(checkpoint_dir(str(tmp_path), step))
    os.makedirs(tmp_path / "checkpoint-last")
    assert [checkpoint_step(p) for p in checkpoints(str(tmp_path))] == [9, 10, 100]
    assert checkpoints(str(tmp_path / "missing")) == []


def test_publish_renames_a_staged_checkpoint_over_an_older_one_and_removes_the_empty_staging_dir(tmp_path):
    run_dir = str(tmp_path)
    staged = checkpoint_dir(staging_run_dir(run_dir), 4)
    os.makedirs(staged)
    (tmp_path / STAGING_DIR / "checkpoint-4" / "model.safetensors").write_text("new")
    final = checkpoint_dir(run_dir, 4)
    os.makedirs(final)
    (tmp_path / "checkpoint-4" / "stale.bin").write_text("old")
    publish(staged, final)
    assert sorted(os.listdir(final)) == ["model.safetensors"] and not os.path.exists(tmp_path / STAGING_DIR)


def test_clean_staging_removes_what_an_interrupted_save_left(tmp_path):
    assert clean_staging(str(tmp_path)) == []
    half = checkpoint_dir(staging_run_dir(str(tmp_path)), 8)
    os.makedirs(half)
    assert clean_staging(str(tmp_path)) == [half] and not os.path.exists(tmp_path / STAGING_DIR)
