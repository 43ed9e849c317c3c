"""Pure decisions of the NaN guard: which steps were faults, when to roll back, when to give up.

Nothing here touches a tensor or a file: the guard feeds host-side records in and acts on the `Verdict` it gets back,
so every branch is unit-testable with plain numbers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Literal


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step looked like, read back from the device at an inspection point.

    Args:
        step (`int`): the optimizer step (the value of `global_step` after it).
        loss (`float`): the step's training loss, summed over micro-batches (NaN/Inf allowed).
        grad_norm (`float`): the global gradient norm before clipping (NaN/Inf allowed).
        bad (`bool`): whether the guard prevented the update (non-finite loss or gradient on any rank).
        bad_ranks (`tuple[int, ...]`): the ranks whose local loss was non-finite (empty when only the gradient was).
        overflow (`bool`): a loss scaler (fp16) found non-finite scaled gradients and skipped the step itself, with a
            finite loss: the scaler's normal calibration, not a fault.
    """

    step: int
    loss: float
    grad_norm: float
    bad: bool
    bad_ranks: tuple[int, ...] = ()
    overflow: bool = False

    @property
    def what(self) -> list[str]:
        parts = []
        if not math.isfinite(self.loss) or self.bad_ranks:
            parts.append("loss")
        if not math.isfinite(self.grad_norm):
            parts.append("grad_norm")
        return parts or (["update"] if self.bad else [])


@dataclass
class RollingStats:
    """Mean and standard deviation of the last `window` values (excluding the value being judged)."""

    window: int = 64
    values: deque = field(default_factory=deque)

    def add(self, value: float) -> None:
        self.values.append(value)
        while len(self.values) > self.window:
            self.values.popleft()

    def excess(self, value: float, relative_floor: float) -> float:
        """How many standard deviations `value` lies above the mean (0 or less: not above).

        The deviation is measured against `max(std, relative_floor * |mean|)`, so a nearly constant history does
        not turn ordinary noise into a huge score; a history with no spread at all (e.g. GRPO losses that are all
        exactly 0) gives no verdict (`0.0`).
        """
        n = len(self.values)
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / n)
        scale = max(std, relative_floor * abs(mean))
        return (value - mean) / scale if scale > 0 else 0.0


@dataclass
class SpikeDetector:
    """Confirms a spike: `patience` consecutive applied steps whose loss or gradient norm lies more than `threshold`
    rolling standard deviations above its rolling mean (a one-sided z-score, as OLMo-core's skip-step optimizer).

    The statistics cover the last `window` applied steps with finite values; a value is judged only once
    `min_history` of them exist. Z-scores work for losses of any sign and scale (GRPO/RLOO losses sit near 0 and go
    negative), unlike a ratio to the mean. Non-finite values never enter the statistics, and neither do spiking ones.
    """

    threshold: float
    patience: int = 2
    window: int = 64
    min_history: int = 16
    relative_floor: float = 0.05
    loss: RollingStats = field(default_factory=RollingStats)
    grad_norm: RollingStats = field(default_factory=RollingStats)
    streak: int = 0

    def __post_init__(self):
        self.loss.window = self.grad_norm.window = self.window

    def update(self, loss: float, grad_norm: float) -> bool:
        """Feed one applied step; return `True` when a spike is confirmed (the streak then resets)."""
        if self.threshold <= 0 or not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return False
        if grad_norm == 0.0:
            # No learning signal (e.g. a GRPO batch whose groups all have equal rewards): neither judged nor counted,
            # or a sparse-reward run's history would be all zeros and every informative step would look like a spike.
            return False
        if self.spiking(loss, grad_norm):
            self.streak += 1
            if self.streak >= self.patience:
                self.streak = 0
                return True
            return False
        self.streak = 0
        self.loss.add(loss)
        self.grad_norm.add(grad_norm)
        return False

    def spiking(self, loss: float, grad_norm: float) -> bool:
        if len(self.loss.values) < self.min_history:
            return False
        return (
            self.loss.excess(loss, self.relative_floor) > self.threshold
            or self.grad_norm.excess(grad_norm, self.relative_floor) > self.threshold
        )

    @property
    def in_progress(self) -> bool:
        """Whether the last steps were spiking without confirmation yet (no snapshot should be taken now)."""
        return self.streak > 0

    def reset(self) -> None:
        self.streak = 0


Reason = Literal["consecutive_skips", "loss_spike", "nonfinite_state"]


@dataclass(frozen=True)
class Verdict:
    """What to do after inspecting a window of steps.

    Args:
        skipped (`list[StepRecord]`): the steps whose update the guard prevented (faults), in order.
        rollback (`Reason | None`): why the state must be restored, if it must.
        fault_step (`int | None`): the first step of the fault that triggered the rollback.
        consecutive (`int`): consecutive skipped steps at the end of the window (carried to the next window).
        overflows (`list[StepRecord]`): steps the loss scaler skipped itself (not faults).
    """

    skipped: list[StepRecord]
    rollback: Reason | None
    fault_step: int | None
    consecutive: int
    overflows: list[StepRecord] = field(default_factory=list)


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
        spike: the spike detector (updated in place with the finite values of applied steps), or `None`.
        state_finite: whether the weights and optimizer state are finite now.

    Loss-scaler overflows are neither faults nor applied steps: they do not count towards, nor break, a run of
    skips, and they do not feed the spike statistics.
    """
    skipped, overflows = [], []
    rollback: Reason | None = None
    fault_step = None
    for record in records:
        if record.overflow:
            overflows.append(record)
        elif record.bad:
            skipped.append(record)
            consecutive += 1
            if rollback is None and consecutive >= max_consecutive_skips:
                # The run may have started in an earlier window: count back from this step.
                rollback, fault_step = "consecutive_skips", record.step - consecutive + 1
        else:
            consecutive = 0
            if spike is not None and rollback is None and spike.update(record.loss, record.grad_norm):
                rollback, fault_step = "loss_spike", record.step
    if not state_finite and rollback is None:
        rollback = "nonfinite_state"
        fault_step = skipped[0].step if skipped else (records[0].step if records else None)
    return Verdict(skipped, rollback, fault_step, consecutive, overflows)


def unexplained_overflows(records: list[StepRecord], loss_scale: float | None) -> list[StepRecord]:
    """Overflow records the loss scaler cannot explain become faults: once its scale has backed off to 1 or less it no
    longer scales anything, so a non-finite gradient is the gradient's own, however often the scaler skips it."""
    if loss_scale is None or loss_scale > 1.0:
        return records
    return [replace(r, overflow=False, bad=True) if r.overflow else r for r in records]


def can_roll_back(rollbacks_done: int, max_rollbacks: int) -> bool:
    """Whether one more rollback is allowed (`max_rollbacks=0` means: never roll back, abort at the first fault)."""
    return rollbacks_done < max_rollbacks


def syncs_reference_model(args: Any, step: int) -> bool:
    """TRL mixes the policy into the reference model at this step (`sync_ref_model`): it must be verified first."""
    every = max(getattr(args, "ref_model_sync_steps", 1), 1)
    return bool(getattr(args, "sync_ref_model", False)) and step % every == 0
