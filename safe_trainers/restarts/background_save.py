"""Checkpoints written in the background: at most one in flight, published by the same renames as a synchronous save.

With `save_in_background=True` (one process or DDP; not DeepSpeed or FSDP) a save blocks training only while the
state is copied to host memory (`runtime/host_staging.py`) and the small files (RNG states, scheduler, trainer state,
the guard's state) are written to the staging directory. A writer thread then, on the rank that publishes:

1. runs the deferred writes: the model's weights and config (`save_pretrained` of the host copy) and `optimizer.pt`;
2. checks the staged copy as a resume would (complete, readable, finite: [`checkpoint_problem`]);
3. publishes it (`publishing.py`: sealed with fsync and a marker, then renamed in).

Under DDP every rank starts the same save (the others only wrote their RNG states; their writer has nothing to do)
and every rank's readers are told at the same step (`writers_done.py`).

A crash at any point leaves either no sealed copy (removed at the next start) or a sealed, verified one (published at
the next start): never a published, half-written checkpoint. The step record lists it as soon as it is published (on
the writer thread), so a crash before the next step boundary resumes from it. What reads a published checkpoint
(`on_save`, the hub upload, the rotation, the step record, the guard's rollback source) is told on the main thread,
once the writer is done ([`BackgroundSaves.wait`], called by the trainer at a step boundary, before the next save,
before any rollback, before the best model is loaded, before a preemption's exit and before `train()` returns;
`trainer/background_checkpoints.py`).

No collective runs on the writer thread; the writer never touches the live model or optimizer (a model whose
`save_pretrained` reads its live weights, a prompt-learning PEFT model, has its weights written on the training
thread: `runtime/saved_weights.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runtime.host_buffers import HostBuffers
from .publishing import publish


class CheckpointWriteError(RuntimeError):
    """A background write failed, or wrote a checkpoint a resume could not use: it was not published."""


@dataclass
class PendingSave:
    """A checkpoint written in the background, not yet announced to its readers.

    Args:
        step (`int`): its step.
        staged (`str`): the staged copy, `<output_dir>/.safe_trainers_staging/checkpoint-N`.
        final (`str`): its published name, `<output_dir>/checkpoint-N`.
        run_dir (`str`): `output_dir`.
        state (`Any`): a copy of the `TrainerState` as saved (what `on_save` reads: the step, the best checkpoint).
        publishes (`bool`): this rank writes the deferred files and publishes (under DDP, the others wait for it).
        uploads (`bool`): pushed to the Hub once published (`hub_strategy="checkpoint"`); not the guard's starting
            checkpoint (`nan_rollback_from="checkpoint"`).
        on_save_due (`bool`): the Trainer called `on_save` for this save: the callbacks are called once published.
    """

    step: int
    staged: str
    final: str
    run_dir: str
    state: Any
    publishes: bool = True
    uploads: bool = True
    on_save_due: bool = False


@dataclass
class SaveBuffers:
    """The host buffers a background save copies into, reused from one save to the next (touched once)."""

    model: HostBuffers = field(default_factory=lambda: HostBuffers(separate=True))
    optimizer: HostBuffers = field(default_factory=lambda: HostBuffers(separate=True))
    prepared: bool = False  # allocated ahead of the first save (`trainer/background_checkpoints.py`)

    def release(self) -> None:
        self.model.release()
        self.optimizer.release()
        self.prepared = False


class BackgroundSaves:
    """The one writer thread of a run's checkpoints (see the module docstring).

    Args:
        problem (`Callable[[str], str | None]`): why a staged copy cannot be resumed from, or `None`
            ([`checkpoint_problem`] with the user's trusted globals).
        published (`Callable[[str, int], None]`, *optional*): called with `output_dir` and the step on the writer
            thread right after a save is published (safe to call from that thread): the step record lists it at
            once, so a crash before its readers are told still resumes from it.
    """

    def __init__(
        self, problem: Callable[[str], str | None], published: Callable[[str, int], None] | None = None
    ):
        self.problem = problem
        self.published = published
        self.buffers = SaveBuffers()
        self.pending: PendingSave | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        """A save was started and its readers were not told yet."""
        return self.pending is not None

    def start(self, pending: PendingSave, writes: Sequence[Callable[[], None]], ready: Callable[[], None]) -> None:
        """Write, check and publish `pending` on the writer thread. `writes`: the deferred file writes, run in
        order after `ready()` (the host copies have landed). Only one save may be in flight: [`wait`] first."""
        if self.pending is not None:
            raise RuntimeError(f"checkpoint-{self.pending.step} is still in flight; wait for it before another save")
        self.pending, self._error = pending, None
        self._thread = threading.Thread(
            target=self._write, args=(pending, tuple(writes), ready), name="safe_trainers-checkpoint", daemon=True
        )
        self._thread.start()

    def done(self) -> bool:
        """Whether the save in flight (if any) has finished writing (its readers are told by [`wait`])."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> PendingSave | None:
        """Wait for the writer; return the save it published (its readers are to be told now), or `None` when none
        was in flight. Raise [`CheckpointWriteError`] when the write failed (nothing was published)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        pending, self.pending = self.pending, None
        error, self._error = self._error, None
        if error is not None:
            step = pending.step if pending is not None else "?"
            raise CheckpointWriteError(
                f"The background save of checkpoint-{step} failed and was not published: {error}. The previous "
                "checkpoint stands. Set `save_in_background=False` to write checkpoints on the training thread."
            ) from error
        return pending

    def close(self) -> None:
        """Join the writer (a `train()` call left by an exception: a sealed copy is published, or left unsealed and
        removed at the next start) and drop what is pending; the buffers are kept for the next `train()` call."""
        if self._thread is not None:
            self._thread.join()
        self._thread, self.pending, self._error = None, None, None

    # ------------------------------------------------------------------ writer thread
    def _write(self, pending: PendingSave, writes: tuple[Callable[[], None], ...], ready: Callable[[], None]) -> None:
        try:
            ready()
            for write in writes:
                write()
                self.written(pending, write)
            if not pending.publishes:
                return
            problem = self.problem(pending.staged)
            if problem is not None:
                raise CheckpointWriteError(f"`{pending.staged}` was written but cannot be resumed from: {problem}")
            publish(pending.staged, pending.final)
            if self.published is not None:
                self.published(pending.run_dir, pending.step)
        except BaseException as error:  # kept for the main thread, which raises it at `wait`
            self._error = error

    def written(self, pending: PendingSave, write: Callable[[], None]) -> None:
        """Called on the writer thread after each deferred write (nothing by default; tests subclass it to hold a
        write in progress)."""


__all__ = ["BackgroundSaves", "CheckpointWriteError", "PendingSave", "SaveBuffers"]
