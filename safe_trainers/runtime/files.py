"""Files the run writes under fixed names in `output_dir` and in its checkpoints, written so that a symbolic link at
that name never redirects the write outside `output_dir`, and made durable where a checkpoint depends on it.

Two kinds of write, two answers to a link found at the name:

* a whole file ([`write_text_no_follow`]: `safety_report.json`, `nan_guard_state.json`, the event log rewritten on a
  resume): written to a new temporary file beside it (created with `O_EXCL | O_NOFOLLOW`, so nothing that was there is
  opened), then renamed over the name. A rename replaces the link itself, never its target: the link is gone and
  the file is ours.
* in place ([`open_no_follow`], [`open_append_no_follow`]: the step record, the event log, hang stacks): opened with
  `O_NOFOLLOW`; a link there is refused with a `FileExistsError` that names the path, its target and the fix.

Only the last component is protected: `output_dir` itself may be a link the user chose.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Callable
from typing import IO, Any

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def link_refused(path: str) -> FileExistsError:
    """The error for a symbolic link found where the run writes one of its files in place."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return FileExistsError(
        errno.EEXIST,
        f"`{path}` is a symbolic link (to `{target}`); safe_trainers writes this file in place and never through a "
        f"link, which could point outside `output_dir`. Remove the link (`rm '{path}'`) or choose another "
        "`output_dir`; nothing was written through it",
        path,
    )


def open_no_follow(path: str, flags: int = 0, mode: int = 0o644) -> int:
    """`os.open(path, O_WRONLY | O_CREAT | flags)` that refuses a symbolic link at `path` ([`link_refused`]) and any
    other non-regular file. Returns the file descriptor."""
    try:
        fd = os.open(path, _CREATE | flags, mode)
    except OSError as error:
        if error.errno == errno.ELOOP or os.path.islink(path):
            raise link_refused(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        message = f"`{path}` is not a regular file; remove it or choose another `output_dir`"
        raise FileExistsError(errno.EEXIST, message, path)
    return fd


def open_append_no_follow(path: str) -> IO[str]:
    """A text file opened for appending at `path` (created if missing); a symbolic link there is refused."""
    return os.fdopen(open_no_follow(path, os.O_APPEND), "a")


def write_text_no_follow(path: str, text: str, durable: bool = False) -> None:
    """Write `text` as the whole of `path`: into a new temporary file beside it, then renamed over it, so a reader
    sees the old file or the new one and a symbolic link at `path` is replaced, its target untouched.

    Args:
        path (`str`): the file to write.
        text (`str`): its new content.
        durable (`bool`): fsync the file before the rename (the directory is the caller's to fsync).
    """
    write_file_no_follow(path, lambda f: f.write(text), durable=durable)


def write_file_no_follow(path: str, write: Callable[[IO], Any], binary: bool = False, durable: bool = False) -> None:
    """[`write_text_no_follow`] for any content: `write(f)` fills the temporary file (opened in binary mode with
    `binary`, e.g. for `torch.save`), which is then renamed over `path`."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = open_no_follow(tmp, os.O_EXCL)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def fsync_path(path: str) -> None:
    """Flush a file or a directory (its entries) to stable storage; a symbolic link is not followed (left alone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Flush every file and directory under `root`, deepest first, then `root` itself (links are not followed)."""
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)


__all__ = [
    "fsync_path", "fsync_tree", "link_refused", "open_append_no_follow", "open_no_follow", "write_file_no_follow",
    "write_text_no_follow",
]  # fmt: skip
