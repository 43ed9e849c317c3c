"""Pure decisions of the NaN guard: which steps were faults, when to roll back, when to give up.

Nothing here touches a tensor or a file: the guard feeds host-side records in and acts on the `Verdict` it gets back,
so every branch is unit-testable with plain numbers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step looked like, read back from the device at an inspection point.

    Args:
        step (`int`): the optimizer step (the value of `global_step` after it).
        loss (`float`): the step's training loss, summed over micro-batches (NaN/Inf allowed).
        grad_norm (`float`): the global gradient norm before clipping (NaN/Inf allowed).
        bad (`bool`): whether the guard prevented the update (non-finite loss or gradient on any rank).
        bad_ranks (`tuple[int, ...]`): the ranks whose local loss was non-finite (empty when only the gradient was).
    """

    step: int
    loss: float
    grad_norm: float
    bad: bool
    bad_ranks: tuple[int, ...] = ()

    @property
    def what(self) -> list[str]:
        parts = []
        if not math.isfinite(self.loss) or self.bad_ranks:
            parts.append("loss")
        if not math.isfinite(self.grad_norm):
            parts.append("grad_norm")
        return parts or (["update"] if self.bad else [])


@dataclass
class SpikeDetector:
    """Confirms a loss spike: `patience` consecutive finite losses above `factor` x the mean of the last `window`.

    Non-finite losses never enter the running window, so one NaN cannot poison the statistics (OLMo-core's pitfall).
    """

    factor: float
    patience: int = 2
    window: int = 32
    min_history: int = 8
    history: deque = field(default_factory=deque)
    streak: int = 0

    def update(self, loss: float) -> bool:
        """Feed one finite loss; return `True` when a spike is confirmed (the streak then resets)."""
        if self.factor <= 0 or not math.isfinite(loss):
            return False
        spiking = len(self.history) >= self.min_history and loss > self.factor * _mean(self.history)
        if spiking:
            self.streak += 1
            if self.streak >= self.patience:
                self.streak = 0
                return True
            return False
        self.streak = 0
        self.history.append(loss)
        while len(self.history) > self.window:
            self.history.popleft()
        return False

    def reset(self) -> None:
        self.streak = 0


Reason = Literal["consecutive_skips", "loss_spike", "nonfinite_state"]


@dataclass(frozen=True)
class Verdict:
    """What to do after inspecting a window of steps.

    Args:
        skipped (`list[StepRecord]`): the steps whose update was prevented, in order.
        rollback (`Reason | None`): why the state must be restored, if it must.
        fault_step (`int | None`): the first step of the fault that triggered the rollback.
        consecutive (`int`): consecutive skipped steps at the end of the window (carried to the next window).
    """

    skipped: list[StepRecord]
    rollback: Reason | None
    fault_step: int | None
    consecutive: int


def judge_window(
    records: list[StepRecord],
    consecutive: int,
    max_consecutive_skips: int,
    spike: SpikeDetector | None,
    state_finite: bool = True,
) -> Verdict:
    """Decide what a window of steps means.

    Args:
        records: the steps since the last inspection, in order.
        consecutive: skipped steps in a row at the end of the previous window.
        max_consecutive_skips: that many skips in a row call for a rollback.
        spike: the spike detector (updated in place with the finite losses of applied steps), or `None`.
        state_finite: whether the weights and optimizer state are finite now.
    """
    skipped = []
    rollback: Reason | None = None
    fault_step = None
    run_start = None
    for record in records:
        if record.bad:
            skipped.append(record)
            consecutive += 1
            run_start = record.step if consecutive == 1 or run_start is None else run_start
            if rollback is None and consecutive >= max_consecutive_skips:
                rollback, fault_step = "consecutive_skips", run_start
        else:
            consecutive, run_start = 0, None
            if spike is not None and rollback is None and spike.update(record.loss):
                rollback, fault_step = "loss_spike", record.step
    if not state_finite and rollback is None:
        rollback = "nonfinite_state"
        fault_step = skipped[0].step if skipped else (records[0].step if records else None)
    return Verdict(skipped=skipped, rollback=rollback, fault_step=fault_step, consecutive=consecutive)


def can_roll_back(rollbacks_done: int, max_rollbacks: int) -> bool:
    """Whether one more rollback is allowed (`max_rollbacks=0` means: never roll back, abort at the first fault)."""
    return rollbacks_done < max_rollbacks


def _mean(values) -> float:
    return sum(values) / len(values)
