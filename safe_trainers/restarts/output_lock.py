"""One run per `output_dir`: every `train()` call holds a lock on `output_dir/_safe_trainers.lock` from start to end.

Two runs in one `output_dir` (two jobs launched by mistake) destroy each other: the second one's start removes the
checkpoint the first is staging, truncates its step record (a restart of the first would begin again at step 0) and
takes over its event log; its rotation deletes the first one's checkpoints. So the local main process of every node
(every node that writes there) takes the lock when `train()` starts, before it reads or removes anything, and gives it
back when `train()` leaves, by a return or an exception; a second run is refused at its start, on every rank, with
[`OutputDirInUseError`] naming the directory and the process (host, pid) that holds it. It applies with
`nan_guard=False` too: the healthy resume reads the step record there, and transformers' rotation deletes checkpoints.

The lock is a POSIX lock on the whole file, of the open file description (`F_OFD_SETLK`, Linux; else `lockf`): the
kernel drops it when its process ends, however it ends, so a dead process's lock never blocks a restart; it is kept
when the process closes another descriptor of the file (its own Hub upload of `output_dir` reads every file), and a
forked child closes its copy at once ([`_close_in_child`]). NFS carries such locks to the server; the file stays.

The file names the holder ([`Holder`]: host, pid, the launch's elastic agents and restart count, a token of the run),
for the message and for two cases that are not a second run (see [`decide`]):

* a node of the same launch on the same shared storage (`save_on_each_node=True` with one filesystem for all nodes)
  finds the token of its own rank 0: it takes no lock, and removes nothing in `output_dir` (publishing a checkpoint
  and rotation are the holder's: [`publishes_here`]), so one node never removes what another just published;
* a lock still held in the name of an earlier attempt of the same launch: the agent stopped those workers before the
  restart, so the holder is gone (on NFS, a lost node's lock lasts until its lease runs out, about 90 s): the restart
  goes on, with a warning. Limits (filesystems without locks, or node-local ones): docs/guard.md.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import struct
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal

from accelerate.utils import broadcast_object_list, gather_object

from ..errors import OutputDirInUseError
from .agents import agent_identity, launch_agents, restart_count, same_launch

logger = logging.getLogger("safe_trainers")

LOCK_FILE = "_safe_trainers.lock"  # `_`: transformers' Hub uploads of `output_dir` leave it out (its host, pid)
READ_LIMIT = 4096
_HELD_ERRNOS = {errno.EACCES, errno.EAGAIN}
_NO_LOCKS_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
_WHOLE_FILE = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)  # `struct flock`: write lock, no pid (OFD)

Role = Literal["holds", "peer", "unlocked", "after_dead_attempt", "refused"]


@dataclass(frozen=True)
class Holder:
    """What the lock file says about the run that holds it.

    Args:
        host (`str`), pid (`int`): the process that took the lock (the run's rank 0, or a node's local main).
        launch (`tuple[str, ...]`): the launch's elastic agents (`launch.launch_agents`).
        restart (`int`): the agent's restart count when the lock was taken.
        token (`str`): the same for every process of one `train()` call of one launch, new for each.
    """

    host: str
    pid: int
    launch: tuple[str, ...] = ()
    restart: int = 0
    token: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Holder | None:
        """The holder a lock file names, or `None` for anything else (empty, cut short, another format)."""
        try:
            raw = json.loads(text)
            return cls(str(raw["host"]), int(raw["pid"]), tuple(str(a) for a in raw["launch"]),
                       int(raw["restart"]), str(raw["token"]))  # fmt: skip
        except (ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class Refusal:
    """A process could not take the lock: `holder` holds it (`None`: its file names none yet)."""

    holder: Holder | None


def decide(ours: Holder, seen: Holder | None, locked: bool | None) -> Role:
    """This process's part in the run's hold on `output_dir`.

    Args:
        ours: this run (its token is rank 0's).
        seen: the holder the lock file named (read before the lock was tried, and again if it was held).
        locked: `True` the lock was taken, `False` another process holds it, `None` the filesystem has no locks.
    """
    if seen is not None and seen.token == ours.token:
        return "peer"  # this launch's rank 0 holds the lock on the same storage
    if locked is None:
        return "unlocked"
    if locked:
        return "holds"
    if seen is not None and same_launch(seen.launch, seen.restart, ours.launch, ours.restart):
        return "after_dead_attempt"
    return "refused"


@dataclass
class OutputDirLock:
    """One process's hold on `output_dir` during a `train()` call (`role` `None`: this process takes no lock)."""

    path: str
    role: Role | None = None
    fd: int | None = None

    @property
    def publishes(self) -> bool:
        """Whether this process may publish, rotate and remove in `output_dir` (not a node sharing the holder's)."""
        return self.role != "peer"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the lock
            self.fd = None
            _HELD.pop(os.path.realpath(self.path), None)


_HELD: dict[str, int] = {}  # the lock files this process holds, and their descriptors (a `train()` call holds it now)


def _close_in_child() -> None:
    """In a child this process forks: the parent's lock stays the parent's alone, ending with it."""
    for fd in _HELD.values():
        os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


@contextmanager
def hold_output_dir(args: Any) -> Iterator[OutputDirLock]:
    """Hold `args.output_dir` for the block (a `train()` call); raise [`OutputDirInUseError`] on every rank when
    another live run holds it. Collectives: every rank enters."""
    lock = acquire(args)
    try:
        yield lock
    finally:
        lock.release()


def acquire(args: Any) -> OutputDirLock:
    """Rank 0 takes the lock first and writes its [`Holder`]; then the local main of every other node, which finds
    rank 0's token there when the nodes share the storage. A refusal anywhere is raised on every rank."""
    path = os.path.join(args.output_dir, LOCK_FILE)
    agents = launch_agents(gather_object([agent_identity(os.environ)]))
    mine, ours, refused, failed = OutputDirLock(path), None, None, None
    if args.process_index == 0:
        ours = Holder(socket.gethostname(), os.getpid(), agents, restart_count(os.environ), uuid.uuid4().hex)
        mine, refused, failed = take(path, ours)
    ours, refused, failed = broadcast_object_list([(ours, refused, failed)])[0]
    if refused is None and failed is None:
        if args.local_process_index == 0 and args.process_index != 0:
            mine, refused, failed = take(path, ours)
        answers = gather_object([(refused, failed)])
        refused = next((r for r, _ in answers if r is not None), None)
        failed = next((f for _, f in answers if f is not None), None)
    if failed is not None:  # raised on every rank, so none waits for the others in a collective
        mine.release()
        raise failed
    if refused is not None:
        mine.release()
        holder = refused.holder
        raise OutputDirInUseError(
            in_use_message(args.output_dir, path, holder), args.output_dir, holder.host if holder else "",
            holder.pid if holder else 0,
        )  # fmt: skip
    return mine


def take(path: str, ours: Holder) -> tuple[OutputDirLock, Refusal | None, OSError | None]:
    """Try the lock at `path` for the run `ours`, without waiting; on success the file names `ours`. An `OSError` (a
    link at the lock file, permissions, a full disk) is returned, for every rank to raise."""
    try:
        return (*_take(path, ours), None)
    except OSError as error:
        return OutputDirLock(path), None, error


def _take(path: str, ours: Holder) -> tuple[OutputDirLock, Refusal | None]:
    key = os.path.realpath(path)
    if key in _HELD:  # a `train()` call of this process holds it now
        return OutputDirLock(path, "refused"), Refusal(Holder(socket.gethostname(), os.getpid()))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    seen = read_holder(path)
    if seen is not None and seen.token == ours.token:
        return OutputDirLock(path, "peer"), None
    fd = _open(path)
    locked = try_lock(fd)
    if locked is False:
        seen = read_holder(path)  # with no lock taken: closing this descriptor drops nothing
    role = decide(ours, seen, locked)
    if role == "refused":
        os.close(fd)
        return OutputDirLock(path, role), Refusal(seen)
    if role == "unlocked":
        logger.warning(
            f"`output_dir` {os.path.dirname(path)!r} is on a filesystem without file locks: a second run in it is "
            "not refused. Run one job per `output_dir` (or mount it with locks: NFS without `nolock`, Lustre with "
            "`flock`)."
        )
    elif role == "after_dead_attempt":  # the agent stopped those workers before this restart
        logger.warning(
            f"The lock on {path} is still held in the name of attempt {seen.restart} of this launch (process "
            f"{seen.pid} on host {seen.host!r}), whose workers the elastic agent stopped before this restart: going "
            "on without it (on shared storage a lost node's lock lasts until its lease runs out)."
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, ours.to_json().encode(), 0)
    os.fsync(fd)  # before the other nodes look for this run's token
    _HELD[key] = fd
    return OutputDirLock(path, role, fd), None


def try_lock(fd: int) -> bool | None:
    """Take the lock on the whole file without waiting ([`_lock`]): `True`, `False` when another process holds it,
    `None` when the filesystem has no locks."""
    try:
        _lock(fd)
    except OSError as error:
        if error.errno in _HELD_ERRNOS:
            return False
        if error.errno in _NO_LOCKS_ERRNOS:
            return None
        raise
    return True


def _lock(fd: int) -> None:
    """The lock of the open file description where the kernel has it (no other descriptor of the file drops it),
    else a record lock."""
    if _OFD_SETLK is not None:
        try:
            fcntl.fcntl(fd, _OFD_SETLK, _WHOLE_FILE)
            return
        except OSError as error:
            if error.errno != errno.EINVAL:  # EINVAL: a kernel or filesystem without them
                raise
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def read_holder(path: str) -> Holder | None:
    """The [`Holder`] the lock file names (at most `READ_LIMIT` bytes read; a link is not followed), or `None`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return Holder.from_json(os.read(fd, READ_LIMIT).decode(errors="replace"))
    except OSError:
        return None
    finally:
        os.close(fd)


def publishes_here(args: Any, lock: OutputDirLock | None) -> bool:
    """Whether this process publishes checkpoints and rotates in `output_dir`: it saves (`args.should_save`) and is
    not a node that shares the storage of its launch's rank 0 (`save_on_each_node=True` on shared storage; `lock`:
    this process's hold, `None` outside `train()`)."""
    return args.should_save and (lock is None or lock.publishes)


def in_use_message(output_dir: str, path: str, holder: Holder | None) -> str:
    who = f"process {holder.pid} on host {holder.host!r}" if holder else "a process whose lock file names none yet"
    return (
        f"`output_dir={output_dir!r}` is in use by another training run: {who} holds its lock ({path}). Two runs in "
        "one `output_dir` delete each other's checkpoints and overwrite each other's step record and event log. Wait "
        "for that run to end or stop it, or give this run another `output_dir`. (A process that ended holds no lock; "
        "on shared storage, a lost node's lock is freed when its lease runs out, about 90 s on NFSv4.)"
    )


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise OSError(
            errno.ELOOP, f"{path} is a symbolic link: the run's lock file must be a plain file in `output_dir`. "
            "Remove the link and start again", path,
        ) from error  # fmt: skip
