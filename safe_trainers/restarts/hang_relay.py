"""Hangs seen on one rank reach the run's event log: the watchdog's reports ride on the guard's per-step all-reduce.

Each rank's hang watchdog (`watchdog.py`) is its own: a step of rank 1 that ran past its bound and then went on
(`hang_action="report"`, or `"auto"` with nothing to restart the process) is in rank 1's log line and stacks file, but
the event log (`nan_events.jsonl`), the timeline and the reporting to TensorBoard and W&B are the main process's. The
[`HangRelay`] carries it there with no collective of its own and no host synchronisation:

1. The watchdog's thread hands the hang to [`HangRelay.reported`] (a host queue).
2. At the end of the next step, the oldest hang not relayed yet rides on the guard's all-reduce (a [`FlagRider`] that
   hands in a vector, `runtime/ports.py`): `SLOT` values per rank, this rank's slot filled ([`hang_slots`]: the
   hang's step + 1, its seconds and its bound), every other slot 0; the all-reduce's maximum is every rank's slot.
3. Each rank reads the agreed values of step `s` at the end of step `s + READ_LAG`, as the preemption bits
   (`runtime/agreed_values.py`: on a GPU, copied to pinned host memory behind an event, long complete by then), and
   the main process adds a `hang` event for each other rank whose slot is set ([`relayed_hangs`]): at the hang's
   step, with `ranks=[r]`, the seconds, the bound, that rank's stacks file and `relayed_from=r`. Its own hangs are in
   the log already (the watchdog adds them).
4. At the end of training (the watchdog stopped) the hangs not relayed yet, and the agreed values not read yet, are
   read with one more all-reduce per `train()` call ([`HangRelay.train_ended`]). A `train()` left by an exception
   (a preemption's exit at the step every rank stops at, an abort) has no `on_train_end`: the values already agreed
   are read as it leaves, with no collective ([`HangRelay.train_left`]); a hang reported after the last all-reduce
   is then in its rank's log line and stacks file only.

The relay is built on every rank under several ranks, whatever each rank's `hang_timeout` (`trainer/run.py`): every
rank must hand the guard's all-reduce the same values; a rank whose watchdog is off hands in an empty slot, and as
the main process still records the other ranks' hangs.

A hang that never ends is not relayed: its rank reaches no all-reduce again (it is stuck, or it exited with status
124). The other ranks then wait for it in a collective, and their own watchdogs report their own stalled steps.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..runtime.collectives import distributed, max_across_ranks
from ..runtime.events import EventLog, RunEvent
from ..runtime.agreed_values import AgreedValues
from .hang_report import stacks_path
from .preemption import READ_LAG

SLOT = 3  # values per rank: the hang's step + 1 (0: no hang), its seconds, its bound


class Hang(NamedTuple):
    """A hang reported by one rank's watchdog: its `step`, the `seconds` the step had run, the `bound` it passed."""

    step: int
    seconds: float
    bound: float


def hang_slots(rank: int, world_size: int, hang: Hang | None) -> list[float]:
    """The values rank `rank` hands to the all-reduce: its slot holds `hang` (`None`: nothing to relay), the other
    ranks' slots are 0, so the maximum over ranks is every rank's slot."""
    values = [0.0] * (SLOT * world_size)
    if hang is not None:
        values[SLOT * rank : SLOT * (rank + 1)] = [float(hang.step + 1), float(hang.seconds), float(hang.bound)]
    return values


def relayed_hangs(values: Sequence[float], own_rank: int) -> list[tuple[int, Hang]]:
    """The hangs of the other ranks in the agreed `values` ([`hang_slots`], maximum over ranks), as `(rank, hang)`
    in rank order; `own_rank`'s slot is left out (its hang is in its own event log already)."""
    out = []
    for rank in range(len(values) // SLOT):
        step, seconds, bound = values[SLOT * rank : SLOT * (rank + 1)]
        if step > 0 and rank != own_rank:
            out.append((rank, Hang(int(round(step)) - 1, round(float(seconds), 1), round(float(bound), 1))))
    return out


def hang_event(rank: int, hang: Hang, output_dir: str) -> RunEvent:
    """The `hang` event the main process records for a hang relayed from rank `rank` (it went on: not exited)."""
    detail = {
        "seconds": hang.seconds, "bound": hang.bound, "stacks": stacks_path(output_dir, rank), "exited": False,
        "relayed_from": rank,
    }  # fmt: skip
    return RunEvent(hang.step, "hang", [], [rank], detail)


class HangRelay:
    """Carries each rank's reported hangs to the main process's event log (a [`FlagRider`]; the module docstring).

    Args:
        events ([`EventLog`]): the run's event log.
        output_dir (`str`): where each rank writes its stacks (named in the relayed event).
        rank (`int`): this process's global rank.
        world_size (`int`): the number of ranks.
        main (`bool`): this is the main process (the one that records the relayed hangs).
    """

    def __init__(self, events: EventLog, output_dir: str, rank: int, world_size: int, main: bool):
        self.events, self.output_dir, self.rank, self.world_size, self.main = events, output_dir, rank, world_size, main
        self.device: torch.device | None = None
        self.local: torch.Tensor | None = None
        self._set = False  # `local` holds a hang (else zeros)
        self._lock = threading.Lock()  # `reported` comes from the watchdog's thread
        self._queued: deque[Hang] = deque()
        self._agreed = AgreedValues()

    # ------------------------------------------------------------------ the watchdog's thread
    def reported(self, step: int, detail: dict[str, Any]) -> None:
        """This rank's watchdog reported a hang (its `on_hang`; `detail`: the `hang` event's): relay it (the main
        process's own is in its event log already: not sent)."""
        if self.main:
            return
        with self._lock:
            self._queued.append(Hang(step, float(detail.get("seconds", 0.0)), float(detail.get("bound", 0.0))))

    def _take(self) -> Hang | None:
        with self._lock:
            return self._queued.popleft() if self._queued else None

    # ------------------------------------------------------------------ the rider (the guard's `end_step`)
    def train_began(self) -> None:
        """A `train()` call begins: its steps are counted afresh; a hang of an earlier call is not relayed now."""
        with self._lock:
            self._queued.clear()
        self._agreed.clear()

    def local_bit(self, device: Any) -> torch.Tensor | None:
        """This rank's values for the step closing now (changed with `fill_`, only when they change: no transfer).
        The relay is built under several ranks only (`trainer/run.py`)."""
        if self.local is None:
            self.device = torch.device(device)
            self.local = torch.zeros(SLOT * self.world_size, device=self.device)
        hang = self._take()
        if self._set:
            self.local.zero_()
            self._set = False
        if hang is not None:
            for index, value in enumerate((hang.step + 1, hang.seconds, hang.bound), start=SLOT * self.rank):
                self.local[index].fill_(float(value))  # the slot `hang_slots` gives this rank
            self._set = True
        return self.local

    def agreed(self, step: int, values: torch.Tensor) -> None:
        """Keep step `step`'s agreed values ([`AgreedValues`]: read a step later, no wait on the step just queued)."""
        self._agreed.keep(step, values)

    # ------------------------------------------------------------------ reading back (the training loop)
    def step_ended(self, step: int) -> None:
        """Step `step` ended: read the agreed values of the steps up to `step - READ_LAG` and record the hangs."""
        self._record(self._read_through(step - READ_LAG))

    def train_ended(self) -> None:
        """Training ended (the watchdog stopped; every rank, at the same point): the agreed values not read yet, and
        the hangs reported after the last step's all-reduce, one more all-reduce for each (the last says whether any
        rank has more)."""
        self._record(self._read_through(None))
        if self.device is None or not distributed():
            return  # no step ran here: nor on any rank (each rank's steps close the same all-reduces)
        while True:
            with self._lock:
                hang = self._queued.popleft() if self._queued else None
                more = bool(self._queued)
            values = hang_slots(self.rank, self.world_size, hang) + [float(more)]
            agreed = max_across_ranks(torch.tensor(values, device=self.device)).cpu().tolist()
            self._record([agreed[:-1]])
            if not agreed[-1]:
                return

    def train_left(self) -> None:
        """`train()` was left, by a return or an exception (a preemption's exit at its stopping step, an abort): the
        agreed values not read yet (after a return: none, [`train_ended`] read them) are read and recorded here, with
        no collective (the ranks need not all be here) and no wait (a copy the device has not completed is dropped:
        it may be failing). Hangs reported after the last step's all-reduce are not relayed then."""
        self._record(self._read_through(None, wait=False))

    def _read_through(self, step: int | None, wait: bool = True) -> list[list[float]]:
        rows = self._agreed.read_through(step, wait)
        return [values.tolist() for _, values in rows] if self.main else []  # the other ranks record nothing

    def _record(self, rows: list[list[float]]) -> None:
        if not self.main:
            return
        for row in rows:
            for rank, hang in relayed_hangs(row, self.rank):
                self.events.add(hang_event(rank, hang, self.output_dir))


__all__ = ["SLOT", "Hang", "HangRelay", "hang_event", "hang_slots", "relayed_hangs"]
