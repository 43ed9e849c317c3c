"""`runtime/checkpoint_dirs.py`: checkpoint names with transformers' prefix, and the staging directory a checkpoint is
written to (a real directory of this user's); publishing from it is tested in `test_publishing.py`."""

from __future__ import annotations

import os

import pytest
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from safe_trainers.runtime.checkpoint_dirs import (
    STAGING_DIR, checked_staging, checkpoint_dir, checkpoint_step, checkpoints, staging_run_dir,
)  # fmt: skip
from safe_trainers.restarts.publishing import recover_staging


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


def test_recovery_removes_what_an_interrupted_save_left(tmp_path):
    assert recover_staging(str(tmp_path)) == []
    half = checkpoint_dir(staging_run_dir(str(tmp_path)), 8)
    os.makedirs(half)
    removed = f"removed a half-written checkpoint left by an interrupted save: `{half}`"
    assert recover_staging(str(tmp_path)) == [removed]
    assert not os.path.exists(tmp_path / STAGING_DIR)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_staging_dir_of_another_user_is_refused(tmp_path):
    staging = staging_run_dir(str(tmp_path))
    os.makedirs(os.path.join(staging, "checkpoint-8"))
    os.chown(staging, 54321, -1)
    with pytest.raises(PermissionError, match=rf"`{staging}` belongs to another user \(uid 54321"):
        recover_staging(str(tmp_path))
    assert os.listdir(staging) == ["checkpoint-8"]
    with pytest.raises(PermissionError):
        checked_staging(str(tmp_path), create=True)
