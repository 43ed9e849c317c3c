"""A background checkpoint writer held in the middle of a checkpoint's files, for tests: training goes on meanwhile,
and a test looks at what the readers see (or kills the process) while the checkpoint is half-written."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..restarts.background_save import BackgroundSaves, PendingSave


class HeldWrites(BackgroundSaves):
    """[`BackgroundSaves`] whose writer stops after the first file of checkpoint `step` until [`release`].

    Args:
        problem (`Callable[[str], str | None]`): as [`BackgroundSaves`].
        step (`int`): the checkpoint held.
        on_hold (`Callable[[], None]`, *optional*): called on the writer thread when it stops (a test's signal).
        published (`Callable[[str, int], None]`, *optional*): as [`BackgroundSaves`].
    """

    def __init__(
        self, problem: Callable[[str], str | None], step: int, on_hold: Callable[[], None] | None = None,
        published: Callable[[str, int], None] | None = None,
    ):  # fmt: skip
        super().__init__(problem, published)
        self.step = step
        self.on_hold = on_hold
        self.holding = threading.Event()
        self.released = threading.Event()

    def written(self, pending: PendingSave, write: Callable[[], None]) -> None:
        if pending.step == self.step and not self.holding.is_set():
            self.holding.set()
            if self.on_hold is not None:
                self.on_hold()
            self.released.wait()

    def release(self) -> None:
        self.released.set()


def hold_writes(trainer: Any, step: int, on_hold: Callable[[], None] | None = None) -> HeldWrites:
    """Give `trainer` (a safe trainer with `save_in_background=True`) a writer held at checkpoint `step`."""
    run = trainer.safe_run
    held = HeldWrites(run.saves.problem, step, on_hold, run.saves.published)
    run.saves = trainer.callback_handler.saves = held
    return held


__all__ = ["HeldWrites", "hold_writes"]
