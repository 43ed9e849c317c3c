"""The small protocols through which the run's parts meet without importing each other.

The NaN guard (`guard/`) and the machinery that outlives a process (`restarts/`) sit side by side on this layer. Where
one needs the other, it names a protocol here and the integration layer (`trainer/`) hands it the object:

* [`StepClock`]: what times a step (the hang watchdog, `restarts/watchdog.py`); the guard pauses it around work that
  is not part of a step (a snapshot, a restore) and arms it around a collective every rank must reach.
* [`FlagRider`]: a bit (the preemption request, `restarts/preemption.py`) or a small vector (the hangs each rank's
  watchdog reported, `restarts/hang_relay.py`) that rides on the guard's per-step all-reduce, so the ranks agree on
  it with no collective of its own.

The run's event log, the third shared piece, is [`EventLog`] (`events.py`).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Protocol

import torch


class StepClock(Protocol):
    """Times the steps of a run (the hang watchdog)."""

    def paused(self) -> ContextManager[None]:
        """Not timed as part of the step: a copy of the whole state, a restore, a replay, a save."""

    def armed(self) -> ContextManager[None]:
        """Timed like a step, outside one: a collective every rank must reach (a verification before a save)."""


class FlagRider(Protocol):
    """A flag OR-ed, or a vector max-reduced, across ranks on the guard's per-step all-reduce."""

    def local_bit(self, device: Any) -> torch.Tensor | None:
        """This rank's value for the step closing now, on `device`: a 0-d bool tensor (a bit) or a 1-D tensor of
        values of the same length on every rank (`None`: nothing rides this step)."""

    def agreed(self, step: int, bit: torch.Tensor) -> None:
        """The value of step `step` as agreed across ranks (a device tensor: read it later, not now): a bit comes
        back as a 0-d bool tensor (any rank's bit set), a vector as float32 values (each the maximum over ranks)."""


class _Unwatched:
    """No clock (`hang_timeout=0`): nothing is timed."""

    paused = armed = staticmethod(contextlib.nullcontext)


UNWATCHED: StepClock = _Unwatched()

__all__ = ["UNWATCHED", "FlagRider", "StepClock"]
