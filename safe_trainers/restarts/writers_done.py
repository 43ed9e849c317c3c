"""When every rank's background checkpoint writer is done, agreed across ranks with no collective of its own.

Under DDP each rank starts its part of a background save at the same step (`trainer/checkpoints.py`): the rank that
publishes writes the weights and the optimizer on its writer thread, the others only wrote their RNG states. The
checkpoint's readers (`on_save`, the step record, the rotation, the rollback source) are told on every rank at the
same step boundary, since telling them runs a collective (`Trainer._after_published`). Which boundary: the first at
which every rank knows the writers were done. Each rank's "my writer is still busy" bit rides on the guard's per-step
all-reduce (a [`FlagRider`]), is OR-ed across ranks, and is read back one step later ([`AgreedBits`], as the
preemption bit), so a save started at step `k` is announced at the end of step `s + 1` for the first `s > k` whose
agreed bit was clear. No host synchronisation is added to a step; a save that is needed sooner (the next save, the
end of training, any rollback, a preemption's exit) waits for the writers instead (`announce`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.collectives import distributed
from .background_save import BackgroundSaves
from .preemption import READ_LAG, AgreedBits


class WritersDone:
    """The agreed "a writer is still busy" bit of each step (a [`FlagRider`], see the module docstring).

    Args:
        saves ([`BackgroundSaves`]): the run's writer (set to `None` when background saves are turned off).
    """

    def __init__(self, saves: BackgroundSaves | None):
        self.saves = saves
        self.bits: AgreedBits | None = None
        self._done_for: int | None = None  # the step of the save in flight that every writer finished

    def train_began(self) -> None:
        """A `train()` call begins: the steps are counted afresh (a later stage may start again at step 0)."""
        self.bits, self._done_for = None, None

    def local_bit(self, device: Any) -> torch.Tensor | None:
        if self.saves is None or not distributed():
            return None  # a single process asks its own writer (`BackgroundSaves.done`)
        if self.bits is None:
            self.bits = AgreedBits(device)
        return self.bits.local_bit(not self.saves.done())

    def agreed(self, step: int, bit: torch.Tensor) -> None:
        if self.bits is not None:
            self.bits.agreed(step, bit)

    def all_done(self, step: int) -> bool:
        """At the end of step `step`: whether every rank's writer has finished the save in flight (read from the
        agreed bits of the steps up to `step - READ_LAG`; every rank reads the same bits, so all answer alike)."""
        if self.bits is None:
            return False
        agreed = self.bits.read_through(step - READ_LAG)  # read every step, whether a save is in flight or not
        pending = self.saves.pending if self.saves is not None else None
        if pending is None:
            return False
        for at, busy in agreed:
            if at > pending.step and not busy:  # a bit of a step that ended after the save began
                self._done_for = pending.step
        return self._done_for == pending.step


__all__ = ["WritersDone"]
