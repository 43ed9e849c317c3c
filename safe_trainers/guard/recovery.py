"""The guard's actions on a verdict: record skips and overflows, roll back to the last good state, or stop the run.

A rollback puts back the weights and optimizer state of the last snapshot, the best-model bookkeeping with them, and
backs the learning rate off. It rewinds nothing else: `global_step`, the data position, the LR schedule position, the
loss scaler and the token counters go on, so the run keeps its length, resume stays exact and logs stay monotonic
(README, "The run's timeline").
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ..errors import TrainingDivergedError
from .events import NanEvent
from .policy import StepRecord, Verdict
from .snapshot import scale_learning_rate

if TYPE_CHECKING:
    from .guard import NanGuard

logger = logging.getLogger("safe_trainers")


def restore_last_good(guard: NanGuard) -> tuple[int, float]:
    """Put the last snapshot's weights and optimizer state back and back the LR off. Returns (step, new LR)."""
    trainer = guard.trainer
    guard._refresh_best_fields()
    snap = guard.snapshotter.restore(trainer.state)
    best = trainer.state.best_model_checkpoint
    if best is not None and not os.path.isdir(best):
        # The kept timeline's best checkpoint was rotated away while a discarded one was "best": no best now.
        trainer.state.best_model_checkpoint = trainer.state.best_metric = trainer.state.best_global_step = None
    guard.state.lr_scale *= guard.settings.nan_lr_backoff
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    lr = scale_learning_rate(optimizer, trainer.lr_scheduler, guard.settings.nan_lr_backoff)
    guard.state.discarded_steps += trainer.state.global_step - snap.step
    guard.verified_step = trainer.state.global_step  # the restored state was verified when it was taken
    guard._consecutive = 0
    guard.flags.clear()
    guard.batches.clear()
    if guard.spike is not None:
        guard.spike.reset()
    discard = getattr(trainer, "discard_rollouts", None)
    if discard is not None:
        discard()  # GRPO/RLOO: completions sampled by the discarded policy
    return snap.step, lr


def roll_back(guard: NanGuard, verdict: Verdict, records: list[StepRecord], diagnosis: dict | None) -> None:
    """Restore the last good state and go on (see the module docstring); record a `rollback` event."""
    current = guard.trainer.state.global_step
    restored, lr = restore_last_good(guard)
    guard.state.rollbacks += 1
    guard.rollbacks_this_run += 1
    bad = [r for r in records if r.bad]
    what = sorted({w for r in bad for w in r.what}) or (["loss_spike"] if verdict.rollback == "loss_spike" else [])
    if verdict.rollback == "nonfinite_state":
        what = sorted(set(what) | {"weights_or_optimizer_state"})
    detail = {
        "reason": verdict.rollback,
        "fault_step": verdict.fault_step,
        "restored_step": restored,
        "discarded_steps": list(range(restored + 1, current + 1)),
        "learning_rate": lr,
        "rollbacks": guard.state.rollbacks,
    }
    if diagnosis is not None:
        detail["first_nonfinite_module"] = diagnosis
    ranks = sorted({rank for r in bad for rank in r.bad_ranks} | set(guard.damaged_ranks))
    guard.events.add(NanEvent(current, "rollback", what, ranks, detail))
    discarded = (
        f"the updates of steps {restored + 1}-{current} are discarded, their batches are not replayed"
        if current > restored
        else "no update is discarded (the state was damaged after the step was verified)"
    )
    logger.warning(
        f"NaN guard: restored the weights and optimizer state of step {restored} at step {current} "
        f"({verdict.rollback}); {discarded}, and the learning rate is now {lr:.3g}. Training goes on from step "
        f"{current}."
    )


def restore_at_end(guard: NanGuard) -> None:
    """When training has ended with a state damaged after the guard's last check (a callback later in the list, at
    the last `on_step_end` or at `on_train_end`): put back the last good state, so that `save_model()` writes a finite
    model. The best checkpoint when `load_best_model_at_end` loaded one (it is what the run ends with), else the
    last snapshot. No backoff and no counter: training is over. Records a `restore` event."""
    trainer = guard.trainer
    step, damaged = trainer.state.global_step, list(guard.damaged_ranks)
    best = trainer.state.best_model_checkpoint
    if trainer.args.load_best_model_at_end and best and os.path.isdir(best):
        trainer._load_best_model()
        detail = {"restored_from": best, "restored_step": trainer.state.best_global_step}
    else:
        snap = guard.snapshotter.restore(trainer.state)
        detail = {"restored_from": "snapshot", "restored_step": snap.step}
    guard.verified_step = step
    detail["reason"] = "damaged_after_last_check"
    guard.events.add(NanEvent(step, "restore", ["weights_or_optimizer_state"], damaged, detail))
    logger.warning(
        f"NaN guard: the weights or optimizer state became non-finite after the last check of step {step} (a "
        f"callback after the guard's?); restored the last good state ({detail['restored_from']}, step "
        f"{detail['restored_step']}) so the final model is finite."
    )


def abort(guard: NanGuard, verdict: Verdict) -> None:
    """Restore the last good state, save it as a checkpoint, record an `abort` event and raise."""
    trainer = guard.trainer
    current = trainer.state.global_step
    restored, lr = restore_last_good(guard)
    checkpoint = None
    try:
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        checkpoint = os.path.join(trainer._get_output_dir(trial=None), f"checkpoint-{current}")
    except Exception as error:  # report, but never hide the divergence behind a save error
        logger.error(f"NaN guard: could not save the last good state: {error}")
    detail = {
        "reason": verdict.rollback,
        "fault_step": verdict.fault_step,
        "restored_step": restored,
        "rollbacks": guard.state.rollbacks,
        "learning_rate": lr,
        "checkpoint": checkpoint,
    }
    guard.events.add(NanEvent(current, "abort", [verdict.rollback or "unknown"], [], detail))
    raise TrainingDivergedError(
        abort_message(guard, verdict, restored, current, lr, checkpoint),
        checkpoint_dir=checkpoint,
        report_path=guard.events.path,
    )


def abort_message(
    guard: NanGuard, verdict: Verdict, restored: int, current: int, lr: float, checkpoint: str | None
) -> str:
    head = (
        f"Training diverged: step {verdict.fault_step} started a fault ({verdict.rollback}) after "
        f"{guard.rollbacks_this_run} rollback(s) (`nan_max_rollbacks={guard.settings.nan_max_rollbacks}`); every "
        f"event is in {guard.events.path}."
    )
    if checkpoint is None:
        return f"{head} The last good state (step {restored}) could not be saved (see the log)."
    return (
        f"{head} The last good weights (those of step {restored}) were saved as {checkpoint}, with the learning rate "
        f"already backed off to {lr:.3g} (x{guard.state.lr_scale:g}). To go on from there, past the batches that "
        f"diverged: `trainer.train(resume_from_checkpoint={checkpoint!r})` (scripts: `--resume_from_checkpoint "
        f"{checkpoint}`). A lower `learning_rate` passed when resuming is applied too (the backoff multiplies it); "
        "also check the data around the listed steps, or raise `nan_max_rollbacks`."
    )


def record_skips(guard: NanGuard, skipped: list[StepRecord], diagnosis: dict | None) -> None:
    """Count and log the steps whose update was prevented; the first carries the diagnosis."""
    for i, record in enumerate(skipped):
        guard.state.skipped_steps += 1
        detail: dict[str, Any] = {"loss": record.loss, "grad_norm": record.grad_norm}
        if i == 0 and diagnosis is not None:
            detail["first_nonfinite_module"] = diagnosis
        guard.events.add(NanEvent(record.step, "skip", record.what, list(record.bad_ranks), detail))
    guard.ledger.record_skips(len(skipped))
    if skipped:
        logger.warning(
            f"NaN guard: {len(skipped)} update(s) with a non-finite loss or gradient were not applied "
            f"(steps {[r.step for r in skipped]}). See {guard.events.path}."
        )


def record_overflows(guard: NanGuard, overflows: list[StepRecord]) -> None:
    """Count and log the loss scaler's own skips (not faults)."""
    for record in overflows:
        guard.state.overflow_steps += 1
        guard.events.add(NanEvent(record.step, "overflow", ["grad_norm"], [], {"loss": record.loss}))


def refuse_save(guard: NanGuard, step: int) -> None:
    """Record that a checkpoint was not written because the state is non-finite."""
    guard.events.add(NanEvent(step, "save_refused", ["weights_or_optimizer_state"], [], {}))
    logger.error(
        f"NaN guard: checkpoint-{step} was NOT written: the weights or optimizer state are non-finite. The last "
        "clean checkpoint is kept."
    )
