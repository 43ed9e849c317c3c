"""Pure decisions of the NaN guard: which steps were faults, when to roll back, when to give up.

Nothing here touches a tensor or a file: the guard feeds host-side records in and acts on the `Verdict` it gets back,
so every branch is unit-testable with plain numbers. (Spikes are judged on the device, before the update: see
`spikes.py`; a record here says whether its step spiked.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal


@dataclass(frozen=True)
class StepReading:
    """What one optimizer step looked like, read back from the device at an inspection point.

    Args:
        step (`int`): the optimizer step (the value of `global_step` after it).
        loss (`float`): the step's training loss, summed over micro-batches (NaN/Inf allowed).
        grad_norm (`float`): the global gradient norm before clipping (NaN/Inf allowed).
        bad (`bool`): whether the guard prevented the update (non-finite loss or gradient on any rank).
        bad_ranks (`tuple[int, ...]`): the ranks whose local loss was non-finite (empty when only the gradient was).
        overflow (`bool`): a loss scaler (fp16) found non-finite scaled gradients and skipped the step itself, with a
            finite loss: the scaler's normal calibration, not a fault.
        spike (`bool`): the spike detector found the step's loss or gradient norm far above its recent values (see
            `spikes.py`); its update was skipped, on the device, unless DeepSpeed had already applied it.
        judged_loss (`float`): the loss the spike detector judged: the largest rank's, the same on every rank (`loss`
            is this rank's own).
    """

    step: int
    loss: float
    grad_norm: float
    bad: bool
    bad_ranks: tuple[int, ...] = ()
    overflow: bool = False
    spike: bool = False
    judged_loss: float = math.nan

    @property
    def what(self) -> list[str]:
        parts = []
        if not math.isfinite(self.loss) or self.bad_ranks:
            parts.append("loss")
        if not math.isfinite(self.grad_norm):
            parts.append("grad_norm")
        return parts or (["update"] if self.bad else [])


Reason = Literal["consecutive_skips", "loss_spike", "nonfinite_state"]


@dataclass(frozen=True)
class Verdict:
    """What to do after inspecting a window of steps.

    Args:
        skipped (`list[StepReading]`): the steps whose update the guard prevented (faults), in order.
        rollback (`Reason | None`): why the state must be restored, if it must.
        fault_step (`int | None`): the first step of the fault that triggered the rollback.
        consecutive (`int`): consecutive skipped steps at the end of the window (carried to the next window).
        overflows (`list[StepReading]`): steps the loss scaler skipped itself (not faults).
        spikes (`list[StepReading]`): the steps the spike detector found spiking (skipped, unless applied by DeepSpeed).
    """

    skipped: list[StepReading]
    rollback: Reason | None
    fault_step: int | None
    consecutive: int
    overflows: list[StepReading] = field(default_factory=list)
    spikes: list[StepReading] = field(default_factory=list)


def judge_window(
    records: list[StepReading],
    consecutive: int,
    max_consecutive_skips: int,
    spikes_applied: bool = False,
    state_finite: bool = True,
) -> Verdict:
    """Decide what a window of steps means.

    Args:
        records: the steps since the last inspection, in order.
        consecutive: skipped steps in a row at the end of the previous window.
        max_consecutive_skips: that many skips in a row (faults or spikes) call for a rollback.
        spikes_applied: the spiking steps were applied (DeepSpeed steps inside `backward`, before the guard's flag
            exists): each calls for a rollback (`"loss_spike"`). Otherwise they were skipped like faults.
        state_finite: whether the weights and optimizer state are finite now.

    Loss-scaler overflows are neither faults nor applied steps: they do not count towards, nor break, a run of
    skips.
    """
    skipped, overflows, spikes = [], [], []
    rollback: Reason | None = None
    fault_step = None
    for record in records:
        if record.overflow:
            overflows.append(record)
        elif record.bad or (record.spike and not spikes_applied):
            (skipped if record.bad else spikes).append(record)
            consecutive += 1
            if rollback is None and consecutive >= max_consecutive_skips:
                # The run may have started in an earlier window: count back from this step.
                rollback, fault_step = "consecutive_skips", record.step - consecutive + 1
        else:
            consecutive = 0
            if record.spike:
                spikes.append(record)
                if rollback is None:
                    rollback, fault_step = "loss_spike", record.step
    if not state_finite and rollback is None:
        rollback = "nonfinite_state"
        fault_step = skipped[0].step if skipped else (records[0].step if records else None)
    return Verdict(skipped, rollback, fault_step, consecutive, overflows, spikes)


def spike_run_rolled_back(verdict: Verdict) -> bool:
    """Whether `verdict` rolls back a run of skipped steps that holds a spiking step: the spike detector's window then
    restarts (see `spikes.py`), since a level that spikes that many steps in a row may be the run's new level."""
    if verdict.rollback != "consecutive_skips" or verdict.fault_step is None:
        return False
    return any(record.step >= verdict.fault_step for record in verdict.spikes)


def diagnosed_step(verdict: Verdict) -> int | None:
    """The step whose micro-batches the one-time NaN diagnosis replays (`diagnosis.py`): the first skipped non-finite
    step, else the first step of a fault found without one in this window (a run of skips begun earlier, a damaged
    state); `None` when nothing non-finite happened (a run of spiking steps is finite)."""
    if verdict.skipped:
        return verdict.skipped[0].step
    if verdict.rollback == "nonfinite_state" or (
        verdict.rollback == "consecutive_skips" and not spike_run_rolled_back(verdict)
    ):
        return verdict.fault_step
    return None


def bundled_steps(verdict: Verdict) -> list[int]:
    """The steps of a window that get a replay bundle (docs/replay.md): those with a `skip` event (a poisoned step
    is one) and the fault step of a `rollback`, in order; spikes and overflows get none."""
    steps = [record.step for record in verdict.skipped]
    if verdict.rollback is not None and verdict.fault_step is not None and verdict.fault_step not in steps:
        steps.append(verdict.fault_step)
    return sorted(steps)


def state_check_step(verdict: Verdict, at_step: int) -> int | None:
    """The step of a rollback that a check of the state found with no faulted step in its window (GRPO/RLOO's check
    before a generation, or any trainer's check before a save or an evaluation after a callback changed the state
    past the step's own check: the weights or optimizer state damaged after the last inspection, no step's loss or
    gradient non-finite): `at_step`, the step it was found at, which its `rollback` event and replay bundle are
    numbered by; `None` for any other verdict. Which step damaged the state is unknown."""
    return at_step if verdict.rollback == "nonfinite_state" and verdict.fault_step is None else None


def unexplained_overflows(records: list[StepReading], loss_scale: float | None) -> list[StepReading]:
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


def inspection_due(
    control: Any, step: int, config: Any, snapshot_due: bool, pending: int, read_steps: int
) -> tuple[bool, bool] | None:
    """Whether the guard inspects where the Trainer is about to log, evaluate or save (every step, before it does):
    `(verify, snapshot)`, or `None` when nothing is due. The state is verified (and a snapshot taken) before every
    save, evaluation, reference-model sync and the end of training, so none of them sees non-finite weights, and when
    a snapshot is `snapshot_due`; a log, or `pending` steps piling up to `read_steps`, only reads the flags.

    Args:
        control: the Trainer's `TrainerControl` for this step (as the flow callback left it).
        step (`int`): `global_step`.
        config: the trainer's config (TRL's reference-model sync settings).
        snapshot_due (`bool`): the snapshot interval has passed since the last snapshot
            ([`SnapshotInterval.snapshot_due`]).
        pending (`int`): the steps whose flags were not read yet.
        read_steps (`int`): read the flags once this many are pending.
    """
    publishing = bool(control.should_save or control.should_evaluate or control.should_training_stop)
    publishing = publishing or syncs_reference_model(config, step)
    if control.should_log or publishing or snapshot_due or pending >= read_steps:
        return publishing or snapshot_due, publishing or snapshot_due
    return None
