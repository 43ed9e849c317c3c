"""Publishing a staged checkpoint under its final name, so that a crash at any point leaves a complete copy, and the
recovery at the next start that finishes or undoes what the crash interrupted.

A checkpoint of step N is written to `<output_dir>/.safe_trainers_staging/checkpoint-N`, verified, and then
published in four steps ([`PUBLISH_STEPS`]), each durable before the next begins:

1. seal: every file and directory of the staged copy is fsynced, then the marker `checkpoint-N.complete` is written
   beside it (fsynced, with the staging directory): the staged copy is complete and verified;
2. set aside: an existing `checkpoint-N` is renamed to `.safe_trainers_staging/checkpoint-N.replaced` (a name
   `checkpoints()` never lists);
3. move in: the staged copy is renamed to `checkpoint-N`; `output_dir` is fsynced. Only now is it published;
4. clean up: the marker and the replaced copy are deleted, and the staging directory when it is empty.

What is on disk after a crash at any point always holds a complete `checkpoint-N` (the old or the new one), and
[`recovery_actions`] decides, from what it finds alone, how to return to a clean state.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..runtime.checkpoint_dirs import checked_staging, checkpoint_dir
from ..runtime.files import fsync_path, fsync_tree, open_no_follow
from .checkpoint_choice import checkpoint_problem

COMPLETE = ".complete"  # beside a staged copy: fully written, verified and fsynced
REPLACED = ".replaced"  # the published copy a publication moved aside
_ENTRY = re.compile(rf"^({re.escape(PREFIX_CHECKPOINT_DIR)}-\d+)({re.escape(COMPLETE)}|{re.escape(REPLACED)})?$")


@dataclass(frozen=True)
class Publication:
    """The paths of one checkpoint's publication.

    Args:
        staged (`str`): the staged copy, `<output_dir>/.safe_trainers_staging/checkpoint-N`.
        final (`str`): its published name, `<output_dir>/checkpoint-N`.
    """

    staged: str
    final: str

    @property
    def staging(self) -> str:
        return os.path.dirname(self.staged)

    @property
    def run_dir(self) -> str:
        """`output_dir` as fsynced: its target when it is a link (a layout users choose; `fsync_path` follows none)."""
        return os.path.realpath(os.path.dirname(self.final))

    @property
    def marker(self) -> str:
        return self.staged + COMPLETE

    @property
    def aside(self) -> str:
        return self.staged + REPLACED


def _seal(p: Publication) -> None:
    fsync_tree(p.staged)
    os.close(open_no_follow(p.marker))
    fsync_path(p.marker)
    fsync_path(p.staging)


def _set_aside(p: Publication) -> None:
    if not os.path.lexists(p.final):  # a link or a file there is set aside too: renamed, never followed
        return
    if os.path.lexists(p.aside):
        _remove(p.aside)  # an older replaced copy: `checkpoint-N` is complete, it is not needed
    os.replace(p.final, p.aside)
    fsync_path(p.staging)
    fsync_path(p.run_dir)


def _move_in(p: Publication) -> None:
    os.replace(p.staged, p.final)
    fsync_path(p.run_dir)
    fsync_path(p.staging)


def _clean_up(p: Publication) -> None:
    if os.path.lexists(p.marker):
        os.unlink(p.marker)
    if os.path.lexists(p.aside):
        _remove(p.aside)
    fsync_path(p.staging)
    if not os.listdir(p.staging):
        os.rmdir(p.staging)
        fsync_path(p.run_dir)


def _restore_aside(p: Publication) -> None:
    os.replace(p.aside, p.final)
    fsync_path(p.run_dir)
    fsync_path(p.staging)


# The steps of a publication, in order (a test runs the first k of them and "dies").
PUBLISH_STEPS: tuple[Callable[[Publication], None], ...] = (_seal, _set_aside, _move_in, _clean_up)


def publish(staged: str, final: str) -> None:
    """Publish the fully written, verified checkpoint `staged` as `final`, replacing an existing copy (see the module
    docstring); when this returns, `final` and its files are on stable storage."""
    publication = Publication(staged, final)
    for step in PUBLISH_STEPS:
        step(publication)


@dataclass(frozen=True)
class Found:
    """What a crash may have left of one checkpoint's publication.

    Args:
        staged (`bool`): the staged copy is there.
        complete (`bool`): its marker is there (the staged copy was sealed).
        aside (`bool`): a replaced copy is there.
        published (`bool`): `checkpoint-N` is there.
        damaged (`bool`): the sealed copy is no longer usable (a disk error, a stray write since it was sealed).
    """

    staged: bool
    complete: bool
    aside: bool
    published: bool
    damaged: bool = False


def recovery_actions(found: Found) -> tuple[str, ...]:
    """What to do, in order, with what a crash left (keys of [`ACTIONS`]): a sealed copy is published; an unsealed
    one (or a damaged one) is removed; a replaced copy is put back when `checkpoint-N` is missing, else removed."""
    if found.staged and found.complete and not found.damaged:
        return ("publish",)  # sets aside, moves in and cleans up, whatever of that was done already
    actions = ("discard_staged",) if found.staged else ()
    if found.aside:
        actions += ("discard_aside",) if found.published else ("restore_aside",)
    if found.complete:
        actions += ("drop_marker",)
    return actions


def _finish(p: Publication) -> None:
    for step in PUBLISH_STEPS[1:]:  # each skips what was done already
        step(p)


# Each action: what it does, and the log line that says so (`None`: not worth a line).
ACTIONS: dict[str, tuple[Callable[[Publication], None], str | None]] = {
    "publish": (
        _finish,
        "published `{final}`: it was fully written and verified before the save publishing it was interrupted",
    ),
    "discard_staged": (
        lambda p: _remove(p.staged),
        "removed a half-written checkpoint left by an interrupted save: `{staged}`",
    ),
    "restore_aside": (
        _restore_aside,
        "put back `{final}`: a save replacing it was interrupted before the new copy was in place",
    ),
    "discard_aside": (lambda p: _remove(p.aside), "removed `{aside}`, the copy a finished publication replaced"),
    "drop_marker": (lambda p: os.unlink(p.marker), None),
}


def recover_staging(run_dir: str, main: bool = True) -> list[str]:
    """Refuse a staging directory that is not the run's own (every process, [`checked_staging`]); on the main
    process, finish or undo each publication a crash interrupted ([`recovery_actions`]) and remove anything else
    there (a link is removed, never followed). Returns a line for each thing done, or that failed to be done.

    Args:
        run_dir (`str`): the run's `output_dir`.
        main (`bool`): this process writes checkpoints there (world process zero).
    """
    staging = checked_staging(run_dir)
    if not main or not os.path.isdir(staging):
        return []
    kinds: dict[str, set[str]] = {}
    lines = []
    for entry in sorted(os.listdir(staging)):
        path = os.path.join(staging, entry)
        match = _ENTRY.match(entry)
        if match and _expected_kind(path, match.group(2) or ""):
            kinds.setdefault(match.group(1), set()).add(match.group(2) or "")
        else:
            lines.append(_tried(lambda path=path: _remove(path), f"removed `{path}`, left in `{staging}`"))
    for name, found in kinds.items():
        p = Publication(os.path.join(staging, name), checkpoint_dir(run_dir, int(name.rsplit("-", 1)[1])))
        state = Found("" in found, COMPLETE in found, REPLACED in found, _is_dir(p.final))
        damaged = _damaged_since_sealed(p, state)
        if damaged is not None:
            lines.append(f"kept `{p.final}`: `{p.staged}`, sealed to replace it, is no longer usable ({damaged})")
            state = replace(state, damaged=True)  # undone like an unsealed copy: the complete copy stays
        for action in recovery_actions(state):
            run, line = ACTIONS[action]
            text = line and line.format(staged=p.staged, final=p.final, aside=p.aside)
            lines.append(_tried(lambda run=run, p=p: run(p), text))
    if os.path.isdir(staging) and not os.listdir(staging):
        os.rmdir(staging)
    return [line for line in lines if line]


def _damaged_since_sealed(p: Publication, found: Found) -> str | None:
    """Why a sealed staged copy cannot replace the complete copy beside it (checked only then: the seal was written
    after its verification, but a disk error or a stray write since would otherwise cost the only good copy)."""
    if not (found.staged and found.complete and (found.published or found.aside)):
        return None
    return checkpoint_problem(p.staged)


def _expected_kind(path: str, suffix: str) -> bool:
    """A staged or replaced copy is a real directory, a marker a real file (anything else, a link above all, is
    removed as it is)."""
    return _is_dir(path) if suffix != COMPLETE else os.path.isfile(path) and not os.path.islink(path)


def _tried(action: Callable[[], object], line: str | None) -> str | None:
    """Run `action`: its log line when it succeeded, or why it failed (nothing is claimed that was not done)."""
    try:
        action()
    except OSError as error:
        return f"could not clean up after an interrupted save: {error}"
    return line


def _is_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _remove(path: str) -> None:
    """Remove a file, a link (never what it points at) or a directory tree (whose links are removed, not followed)."""
    if _is_dir(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


__all__ = ["ACTIONS", "PUBLISH_STEPS", "Found", "Publication", "publish", "recover_staging", "recovery_actions"]
