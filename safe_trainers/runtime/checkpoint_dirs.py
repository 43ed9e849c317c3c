"""Checkpoint directories: their names (`checkpoint-<step>`, transformers' own prefix), and the staging directory a
checkpoint is written to before it is renamed into place (never half-written under its final name; publishing and
the recovery after a crash are in `restarts/publishing.py`)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

STAGING_DIR = ".safe_trainers_staging"
_CHECKPOINT = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)$")


def staging_run_dir(run_dir: str) -> str:
    return os.path.join(run_dir, STAGING_DIR)


def checked_staging(run_dir: str, create: bool = False) -> str:
    """The staging directory of `run_dir`, refused when it is not a real directory of the current user: a symbolic
    link would send the checkpoint's writes, and the deletion of what an interrupted save left, to its target.

    Args:
        run_dir (`str`): the run's `output_dir`.
        create (`bool`): create the directory when it is missing (before a save).

    Raises:
        `FileExistsError`: the path is a symbolic link, or not a directory.
        `PermissionError`: the directory belongs to another user.
    """
    path = staging_run_dir(run_dir)
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return path
        try:
            os.mkdir(path)
        except FileExistsError:
            pass  # another process of this run made it first
        found = os.lstat(path)
    fix = f"Remove it (`rm -r '{path}'`; it holds only checkpoints a save had not finished) and run again"
    if stat.S_ISLNK(found.st_mode):
        raise FileExistsError(
            errno.EEXIST,
            f"The checkpoint staging directory `{path}` is a symbolic link (to `{os.readlink(path)}`): checkpoints "
            "are written there and what an interrupted save left is deleted, so it must be a real directory inside "
            f"`output_dir`; nothing was written or deleted through it. {fix}",
            path,
        )
    if not stat.S_ISDIR(found.st_mode):
        raise FileExistsError(
            errno.EEXIST, f"The checkpoint staging directory `{path}` is not a directory. {fix}", path
        )
    if found.st_uid != os.getuid():
        raise PermissionError(
            errno.EPERM,
            f"The checkpoint staging directory `{path}` belongs to another user (uid {found.st_uid}, this run's is "
            f"{os.getuid()}): the run would write its checkpoints into, and delete from, a directory it does not own. "
            f"Have it removed, or choose another `output_dir`",
            path,
        )
    return path


def checkpoint_dir(run_dir: str, step: int) -> str:
    """The path of the Trainer's checkpoint of step `step` in `run_dir` (`<run_dir>/checkpoint-<step>`)."""
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def checkpoint_step(path: str) -> int | None:
    """The step of a `checkpoint-N` directory (`None` for any other name)."""
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def resumed_step(path: str | None) -> int:
    """The step training resumes at from the checkpoint `path` (0 without one): its name's `checkpoint-N`, else the
    `global_step` of its `trainer_state.json` (a copied or renamed checkpoint), else 0."""
    if not path:
        return 0
    step = checkpoint_step(path)
    if step is not None:
        return step
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            found = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError):
        return 0
    return found if isinstance(found, int) else 0


def checkpoints(run_dir: str) -> list[str]:
    """The published `checkpoint-N` directories of `run_dir`, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(run_dir) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(run_dir, name) for _, name in sorted(found)]
