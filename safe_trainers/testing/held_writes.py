"""A background checkpoint writer held in the middle of a checkpoint's files, for tests: training goes on meanwhile,
and a test looks at what the readers see (or kills the process) while the checkpoint is half-written."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..restarts.background_save import BackgroundSaves, PendingSave


class HeldWrites(BackgroundSaves):
    """[`BackgroundSaves`] whose writer stops after the first file of checkpoint `step` (before it, with
    `before_writing`) until [`release`].

    Args:
        problem (`Callable[[str], str | None]`): as [`BackgroundSaves`].
        step (`int`): the checkpoint held.
        on_hold (`Callable[[], None]`, *optional*): called on the writer thread when it stops (a test's signal).
        published (`Callable[[str, int], None]`, *optional*): as [`BackgroundSaves`].
        before_writing (`bool`, *optional*): stop before the first deferred file, not after it.
    """

    def __init__(
        self, problem: Callable[[str], str | None], step: int, on_hold: Callable[[], None] | None = None,
        published: Callable[[str, int], None] | None = None, before_writing: bool = False,
    ):  # fmt: skip
        super().__init__(problem, published)
        self.step = step
        self.on_hold = on_hold
        self.before_writing = before_writing
        self.holding = threading.Event()
        self.released = threading.Event()
        self.started: list[int] = []  # the steps of the checkpoints handed to the writer, in order

    def start(self, pending: PendingSave, writes, ready: Callable[[], None]) -> None:
        self.started.append(pending.step)
        if not self.before_writing:
            return super().start(pending, writes, ready)

        def ready_then_hold() -> None:
            ready()
            self.written(pending, ready)

        super().start(pending, writes, ready_then_hold)

    def written(self, pending: PendingSave, write: Callable[[], None]) -> None:
        if pending.step == self.step and not self.holding.is_set():
            self.holding.set()
            if self.on_hold is not None:
                self.on_hold()
            self.released.wait()

    def release(self) -> None:
        self.released.set()


class HeldUntilWaited(HeldWrites):
    """[`HeldWrites`] released by the first wait for the held checkpoint: the writer is still writing whenever the
    training thread comes to need it, whatever the machine's speed. `waits` records where the training thread was."""

    def __init__(self, problem, step, published=None, probe: Callable[[], Any] | None = None, before_writing=False):
        super().__init__(problem, step, published=published, before_writing=before_writing)
        self.probe = probe
        self.waits: list[Any] = []

    def wait(self):
        if self.pending is not None and self.pending.step == self.step and not self.released.is_set():
            self.waits.append(self.probe() if self.probe is not None else True)
            self.release()
        return super().wait()


def hold_writes(trainer: Any, step: int, on_hold: Callable[[], None] | None = None) -> HeldWrites:
    """Give `trainer` (a safe trainer with `save_in_background=True`) a writer held at checkpoint `step`."""
    run = trainer.safe_run
    return _install(trainer, HeldWrites(run.saves.problem, step, on_hold, run.saves.published))


def hold_until_waited(
    trainer: Any, step: int, probe: Callable[[], Any] | None = None, before_writing: bool = False
) -> HeldUntilWaited:
    """Give `trainer` a writer held at checkpoint `step` until the training thread waits for it (`probe()` is
    recorded then); with `before_writing`, before it writes any deferred file."""
    run = trainer.safe_run
    return _install(trainer, HeldUntilWaited(run.saves.problem, step, run.saves.published, probe, before_writing))


def _install(trainer: Any, held: HeldWrites) -> Any:
    trainer.safe_run.saves = trainer.callback_handler.saves = held
    if trainer.safe_run.writers is not None:
        trainer.safe_run.writers.saves = held
    return held


__all__ = ["HeldUntilWaited", "HeldWrites", "hold_until_waited", "hold_writes"]
