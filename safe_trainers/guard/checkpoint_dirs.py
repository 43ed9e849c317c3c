"""Checkpoint directories: their names (`checkpoint-<step>`, transformers' own prefix), and the staging directory a
checkpoint is written to before it is renamed into place (never half-written under its final name)."""

from __future__ import annotations

import os
import re
import shutil

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

STAGING_DIR = ".safe_trainers_staging"
_CHECKPOINT = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)$")


def staging_run_dir(run_dir: str) -> str:
    return os.path.join(run_dir, STAGING_DIR)


def publish(staged: str, final: str) -> None:
    """Move a fully written checkpoint from the staging directory to its final name (atomic on one filesystem)."""
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(staged, final)
    staging = os.path.dirname(staged)
    if not os.listdir(staging):
        os.rmdir(staging)


def clean_staging(run_dir: str) -> list[str]:
    """Remove half-written checkpoints left by a crash during saving; return what was removed."""
    staging = staging_run_dir(run_dir)
    if not os.path.isdir(staging):
        return []
    removed = [os.path.join(staging, name) for name in os.listdir(staging)]
    shutil.rmtree(staging, ignore_errors=True)
    return removed


def checkpoint_dir(run_dir: str, step: int) -> str:
    """The path of the Trainer's checkpoint of step `step` in `run_dir` (`<run_dir>/checkpoint-<step>`)."""
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def checkpoint_step(path: str) -> int | None:
    """The step of a `checkpoint-N` directory (`None` for any other name)."""
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def checkpoints(run_dir: str) -> list[str]:
    """The published `checkpoint-N` directories of `run_dir`, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(run_dir) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(run_dir, name) for _, name in sorted(found)]
