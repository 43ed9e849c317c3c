"""How many optimizer steps apart the NaN guard takes its snapshots (a state check and a copy of the state).

By default the interval adapts so that the snapshots take at most `nan_snapshot_budget` (1%) of the run's wall time:
each snapshot measures its own cost (the host time of its check and copy, plus the device delay its copies add, see
`RollbackSource.copy_delay_seconds`; not the time it spent allocating host buffers, a one-time cost) and the wall time
per step since the previous one (snapshots excluded), every rank's largest figure is agreed at the snapshot (where the
ranks meet anyway), and [`choose_interval`] turns the medians of the last [`HISTORY`] figures into the interval:
`ceil(cost / (AIM * budget * step_time))`, at least `nan_snapshot_steps` when set (else 1), at most the checkpoint
interval (`save_steps`). The interval aims at [`AIM`] (half) of the budget, because the budget is a bound and the
figures are estimates: one check + snapshot of the same 189.6M-parameter state took 553 to 857 ms in six runs of
the same bench (`docs/guard.md`, "The cost as runs grow"), so an interval aimed at the whole budget would exceed it in
some runs. Every rank then decides the same from the same figures. It grows at once when the budget asks for it,
and shrinks only when the figures ask for at least [`SHRINK`] times fewer steps ([`next_interval`]), so noise does not
make it swing. The first decision comes before the second snapshot ([`SnapshotInterval.estimate`]): from the first
snapshot's cost (taken before the first step, it holds no optimizer moments yet) scaled to the state's bytes now, so a
run whose snapshots are dear pays for one at the start, not for several while it measures. The one-time costs (the
first snapshot, the buffers' allocations) count against the budget too: what the snapshots so far took beyond `AIM x
budget x` the wall time since training started ([`SnapshotInterval.debt`]) is added to the next snapshot's cost when
an interval is chosen, so they stretch the next interval instead of the run. `nan_snapshot_budget=0` keeps a fixed
interval: `nan_snapshot_steps` (10 when unset).

The flag reads (one cheap transfer of the per-step fault flags) keep the short cadence (`nan_snapshot_steps`, else
10), so skips and their rollbacks come as soon as before; only the check and the copy stretch.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from statistics import median
from typing import Any

import torch

from ..runtime.collectives import distributed, max_across_ranks
from ..runtime.events import EventLog, RunEvent
from .snapshot_bounds import DEFAULT_STEPS, checkpoint_interval, describe, percent

logger = logging.getLogger("safe_trainers")

HISTORY = 5  # the figures a decision takes the median of
AIM = 0.5  # the share of the budget the chosen interval aims at (the figures are estimates; the budget is a bound)
SHRINK = 1.25  # the interval shrinks only when the figures ask for at least this factor fewer steps
LONGEST = 10**9  # an interval with no upper bound: snapshots at saves, evaluations and the end only
TAKEN_KEPT = 10_000  # the snapshot steps [`SnapshotInterval.taken_at`] keeps (the latest): bounded on a long run


def choose_interval(cost: float, step_time: float, budget: float, lower: int, upper: int | None) -> int:
    """The interval (in optimizer steps) whose snapshots take at most `budget` of the wall time, within the bounds:
    the interval aims at [`AIM`] of `budget`, a margin for the error of the figures.

    Args:
        cost (`float`): seconds one snapshot takes (its check and copy).
        step_time (`float`): seconds one optimizer step takes, snapshots excluded.
        budget (`float`): the fraction of the wall time the snapshots may take; `0`: a fixed interval (`lower`).
        lower (`int`): the fewest steps between snapshots (>= 1).
        upper (`int | None`): the most (the checkpoint interval), `None` for no bound.
    """
    top = max(lower, upper if upper is not None else LONGEST)
    if budget <= 0:
        return min(lower, top)
    if not (math.isfinite(cost) and math.isfinite(step_time)) or step_time <= 0:
        return top if cost > 0 else lower
    if cost <= 0:
        return lower
    share = AIM * budget * step_time  # a budget near the smallest float makes it 0, or `cost / share` infinite
    needed = cost / share if share > 0 else math.inf
    return top if needed >= top else max(math.ceil(needed), lower)


def next_interval(current: int, chosen: int) -> int:
    """The interval to keep after a decision that chose `chosen`: a longer one at once (the budget needs it), a shorter
    one only when it is at least [`SHRINK`] times shorter (a longer interval than needed costs less, so small swings
    of the measured figures change nothing)."""
    return chosen if chosen > current or chosen * SHRINK <= current else current


class SnapshotInterval:
    """The interval between the guard's snapshots, and what it is measured from.

    Args:
        settings ([`SafetyArguments`]): `nan_snapshot_steps` (the lower bound, else the interval to start with) and
            `nan_snapshot_budget`.
    """

    def __init__(self, settings: Any):
        set_steps, self.budget = settings.nan_snapshot_steps, settings.nan_snapshot_budget
        self.lower = set_steps or 1
        self.read_steps = set_steps or DEFAULT_STEPS  # the cadence of the flag reads, which never stretches
        self.start_steps = set_steps or DEFAULT_STEPS
        self.steps, self.upper = self.start_steps, None
        self.costs: deque[float] = deque(maxlen=HISTORY)
        self.step_times: deque[float] = deque(maxlen=HISTORY)
        self.decided = False
        self.held: Callable[[], int] | None = None
        self._mark: tuple[float, int] | None = None  # (time, step) right after the last snapshot
        # (cost, state bytes, allocation seconds) of the first snapshot, for [`estimate`]
        self._first: tuple[float, int, float] | None = None
        self._host = 0.0  # host seconds of snapshot work since the mark
        self._spent = 0.0  # seconds of snapshot work since training started, allocations and the first included
        self._began = time.perf_counter()  # when training started
        self._taken: deque[int] = deque(maxlen=TAKEN_KEPT)  # this `train()` call's snapshot steps, see [`taken_at`]
        self._asked = 0  # the latest step a snapshot was due at ([`ask`])

    @property
    def adaptive(self) -> bool:
        return self.budget > 0

    @property
    def taken_at(self) -> list[int]:
        """The steps of this rank's snapshots in this `train()` call, oldest first (the same on every rank; the
        latest [`TAKEN_KEPT`] on a longer run)."""
        return list(self._taken)

    @property
    def spent_seconds(self) -> float:
        """The wall seconds of this rank's snapshot work since this `train()` call began (each call, a resumed one
        too, starts from 0): each snapshot's check and copy, the first snapshot, the host buffers' allocations and
        the check of a snapshot's inspection that rolled back included (not the last step's check when no copy
        follows it: no snapshot's). What [`debt`] weighs against the aimed share of the budget; the debt in the
        events is the largest rank's."""
        return self._spent

    def snapshot_due(self, step: int) -> bool:
        """Whether the interval has passed at `step` since this call's latest snapshot, or the latest step one was due
        at (0 before either): snapshots are spaced from the one before (a save or an evaluation may have brought it
        forward), not laid on multiples of the interval, so the first one after the interval grows comes a whole
        interval after the one before; one refused at a skipped step is due again a whole interval later."""
        return step - max(self._taken[-1] if self._taken else 0, self._asked) >= self.steps

    def ask(self, step: int) -> bool:
        """[`snapshot_due`] for the inspection of `step`, kept when true: that inspection takes the snapshot unless
        the step was skipped (`NanGuard.settle`), and either way the next is counted from `step`."""
        due = self.snapshot_due(step)
        self._asked = step if due else self._asked
        return due

    def start(self, config: Any, state: Any, say: bool = True, held: Callable[[], int] | None = None) -> str:
        """Training starts: set the bounds (`config`: `TrainingArguments`, `state`: the `TrainerState`) and the
        interval to start with; returns what the run starts with, logged when `say`. `held()`: the bytes of the state
        a snapshot copies (for [`estimate`]; `None`: no estimate)."""
        self.held = held
        self.upper = checkpoint_interval(config, state)
        fixed = not self.adaptive  # a fixed interval is the one set, as it always was; else within the bounds
        self.steps = self.start_steps if fixed else min(self.start_steps, max(self.lower, self.upper or LONGEST))
        self.costs.clear()
        self.step_times.clear()
        self.decided, self._mark, self._first, self._host = False, None, None, 0.0
        self._spent, self._began = 0.0, time.perf_counter()
        self._taken.clear()
        self._asked = 0
        bounds = f"{self.lower} to {self.upper} steps (`save_steps`)" if self.upper else f"at least {self.lower} steps"
        if self.upper and self.upper <= self.lower:  # the lower bound wins: the figures cannot move it
            bounds = f"exactly {self.lower} steps (`nan_snapshot_steps` is not below `save_steps`={self.upper})"
        started = f"NaN guard: a snapshot every {self.steps} steps (`nan_snapshot_budget=0`: a fixed interval)."
        if not fixed:
            started = (
                f"NaN guard: a snapshot every {self.steps} steps to start with; the interval adapts so that snapshots "
                f"take at most {percent(self.budget)} of the wall time (`nan_snapshot_budget`; it aims at "
                f"{percent(AIM * self.budget)}, a margin for the measured figures' error), within {bounds}, "
                "measured from the first snapshots and steps (`snapshot_interval` events). Set "
                "`nan_snapshot_budget=0` for a fixed interval."
            )
        if say:
            logger.info(started)
        return started

    @contextmanager
    def timed(self, on: bool = True) -> Iterator[None]:
        """Count the host time inside as snapshot work (the check and the copy), when `on`."""
        if not on:
            yield
            return
        began = time.perf_counter()
        try:
            yield
        finally:
            self._host += time.perf_counter() - began

    def restart(self) -> None:
        """Measure the next step time from now (after a restore, which is no step's time). The snapshot work since the
        last snapshot (the check of the inspection that rolled back) was spent all the same: it stays in the account
        ([`spent_seconds`]), not in the next snapshot's cost."""
        self._spent += self._host
        self._mark, self._host = None, 0.0

    def taken(self, step: int, delay: float | None, allocation: float = 0.0) -> tuple[float, float] | None:
        """A snapshot of `step` was taken (`delay`: the device delay of its copies, if known; `allocation`: the seconds
        it spent allocating host buffers, kept from the first snapshot for [`estimate`]): this rank's figures
        `(cost, step_time)` since the previous one, or `None` when there is nothing to measure (the first snapshot,
        the same step again)."""
        now, mark, cost = time.perf_counter(), self._mark, self._host + (delay or 0.0)
        self._mark, self._host = (now, step), 0.0
        self._taken.append(step)
        if mark is None and self.held is not None:
            self._first = (cost, self.held(), allocation)
        if mark is None or step <= mark[1] or not self.adaptive:
            return None
        return cost, max(now - mark[0] - cost, 0.0) / (step - mark[1])  # the steps' own time: the snapshots' out

    def decide(self, step: int, figures: tuple[float, ...], events: EventLog, estimated: bool = False) -> None:
        """Choose the interval from the figures agreed across ranks, `(cost, step_time[, debt])` (the first two
        folded into the running medians, unless `estimated`: then from them alone; the debt, [`debt`], as agreed);
        record a `snapshot_interval` event at the first decision and whenever the interval changes."""
        if not estimated:
            self.costs.append(figures[0])
            self.step_times.append(figures[1])
        cost, step_time = figures[:2] if estimated else (median(self.costs), median(self.step_times))
        debt = figures[2] if len(figures) > 2 else 0.0
        chosen = choose_interval(cost + debt, step_time, self.budget, self.lower, self.upper)
        previous, self.steps = self.steps, next_interval(self.steps, chosen)
        if self.decided and self.steps == previous:
            return
        self.decided = True
        overhead = cost / (self.steps * step_time) if step_time > 0 else None  # the snapshots' share of the wall time
        detail = {
            "interval": self.steps, "previous": previous, "snapshot_seconds": cost, "step_seconds": step_time,
            "overhead": overhead, "budget": self.budget, "lower": self.lower, "upper": self.upper,
            "estimated": estimated, "debt_seconds": debt,
        }  # fmt: skip
        events.add(RunEvent(step, "snapshot_interval", [], [], detail))

    def estimate(self, step: int, source: Any, port: Any, events: EventLog) -> None:
        """At the step where the second snapshot would be taken, before it, while nothing is decided: decide from the
        first snapshot's cost, scaled to the state's bytes now (the optimizer's moments appear at its first step), plus
        the allocation of the buffers for the bytes the state gained (at the first snapshot's allocation rate), and
        the steps' time since, so that a second snapshot is taken only if the budget allows it. A collective when
        distributed (every rank reaches that step undecided)."""
        first, mark = self._first, self._mark
        if not self.adaptive or self.decided or first is None or mark is None or not self.snapshot_due(step):
            return
        cost, then, allocation = first[0] + (source.copy_delay_seconds() or 0.0), first[1], first[2]
        now = self.held()
        cost *= now / then if then else 1.0
        # The next snapshot allocates buffers for what the state gained since the first (the optimizer's moments): a
        # one-time cost, at the first allocation's rate, that this snapshot pays and a short run never pays back.
        cost += allocation * max(now - then, 0) / then if then else 0.0
        step_time = max(time.perf_counter() - mark[0] - self._host, 0.0) / (step - mark[1])
        self.decide(step, agreed((cost, step_time, self.debt()), port.device), events, estimated=True)

    def debt(self) -> float:
        """The seconds the snapshots so far took beyond the aimed share ([`AIM`] of the budget) of the wall time since
        training started (the first snapshot and the buffers' allocations included); the next interval stretches to
        pay it back."""
        return max(self._spent - AIM * self.budget * (time.perf_counter() - self._began), 0.0)

    def resumed(self, step: int, events: EventLog) -> None:
        """A resumed run starts, at its checkpoint's `step`, from the starting interval (the log keeps the earlier
        run's choices): record it (`resumed`, no figures yet), so the log tells the interval in force at every step."""
        detail = {
            "interval": self.steps, "previous": None, "snapshot_seconds": None, "step_seconds": None, "overhead": None,
            "budget": self.budget, "lower": self.lower, "upper": self.upper, "estimated": False, "debt_seconds": 0.0,
            "resumed": True,
        }  # fmt: skip
        events.add(RunEvent(step, "snapshot_interval", [], [], detail))

    def after_snapshot(self, state: Any, source: Any, port: Any, events: EventLog) -> None:
        """A snapshot was just taken (`state`: the `TrainerState`; `source`: the [`RollbackSource`] that took it, for
        its copies' device delay and the time it spent allocating host buffers, which is left out: a one-time cost):
        measure it and, but at the end of training (no interval left to choose), decide. A
        collective when the interval adapts (every rank takes its snapshots at the same steps; `port.device`)."""
        self._spent += self._host + (source.copy_delay_seconds() or 0.0)
        self._host -= source.allocation_seconds()
        first = not self._taken
        figures = self.taken(state.global_step, source.copy_delay_seconds(), source.allocation_seconds())
        if first and state.global_step > 0 and self.adaptive:
            self.resumed(state.global_step, events)
        if figures is None or state.global_step >= state.max_steps:
            return
        self.decide(state.global_step, agreed((*figures, self.debt()), port.device), events)


def agreed(figures: tuple[float, ...], device: Any) -> tuple[float, ...]:
    """Every rank's largest of each figure (a collective when distributed; one process: its own, no device trip)."""
    if not distributed():
        return figures
    return tuple(max_across_ranks(torch.tensor(figures, dtype=torch.float64, device=device)).tolist())


__all__ = [
    "AIM", "DEFAULT_STEPS", "SnapshotInterval", "checkpoint_interval", "choose_interval", "describe", "next_interval",
]  # fmt: skip
