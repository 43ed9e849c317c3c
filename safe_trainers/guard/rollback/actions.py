"""The guard's actions on a verdict: roll back to the last good state and back the learning rate off.

A rollback puts back the weights and optimizer state of the last snapshot, the best-model bookkeeping with them, and
backs the learning rate off ([`scale_learning_rate`]). It rewinds nothing else: `global_step`, the data position, the
LR schedule position, the loss scaler and the token counters go on, so the run keeps its length, resume stays exact and
logs stay monotonic (README, "The run's timeline").

Each function takes the collaborators it acts on (the [`GuardPort`], the [`RollbackSource`], the [`EventLog`]) and the
values it reports, does its action and returns what it did (a [`Restored`] record); the events are written by
`records.py`; the guard decides when to call them and keeps its own counters and per-window state up to date from what
they return. What only the trainer can do (load a checkpoint, save the abort checkpoint, drop GRPO's rollouts) is not
here: the guard returns it as a decision (`port.py`) and the integration layer does it (`trainer/inspection.py`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ...runtime.events import EventLog, RunEvent
from ..port import GuardPort
from .frozen import repair_frozen
from .source import RollbackSource, param_groups

logger = logging.getLogger("safe_trainers")


@dataclass(frozen=True)
class Restored:
    """What a restore put back.

    Args:
        step (`int | None`): the optimizer step whose state was put back (`None` for a best checkpoint whose step
            the trainer state does not record).
        at_step (`int`): the optimizer step at which it was put back; the run goes on from there.
        learning_rate (`float | None`): the learning rate after the backoff (`None` when the LR was left as it is).
        lr_factor (`float`): the factor the learning rate was multiplied by (`1.0`: left as it is).
        source (`str`): `"snapshot"`, or the path of the best checkpoint that was loaded instead.
    """

    step: int | None
    at_step: int
    learning_rate: float | None = None
    lr_factor: float = 1.0
    source: str = "snapshot"

    @property
    def discarded_steps(self) -> list[int]:
        """The steps whose updates the restore threw away (their batches are not replayed)."""
        return list(range(self.step + 1, self.at_step + 1)) if self.step is not None else []


def restore_last_good(port: GuardPort, source: RollbackSource, lr_backoff: float) -> Restored:
    """Put the last good weights, optimizer state and best-model fields back (the caller has loaded the disk source's
    checkpoint already) and multiply the learning rate by `lr_backoff`."""
    state = port.state
    at_step = state.global_step
    snap = source.restore(state)
    snap.restored_at = at_step
    best = state.best_model_checkpoint
    if best is not None and not os.path.isdir(best):
        # The kept timeline's best checkpoint was rotated away while a discarded one was "best": no best now.
        state.best_model_checkpoint = state.best_metric = state.best_global_step = None
    lr = scale_learning_rate(source.backend.optimizer, port.scheduler, lr_backoff)
    return Restored(snap.step, at_step, learning_rate=lr, lr_factor=lr_backoff)


# -- the learning-rate backoff: the current and the scheduled learning rates, scaled together; the factor is kept
# with the guard's state (`GuardState.lr_scale`) and undone when a new run starts on the same trainer.
def follow_learning_rate(optimizer: Any, scheduler: Any, config: Any, saved: float | None) -> float:
    """After a resume: the checkpoint's optimizer and scheduler carry the backed-off learning rate of `saved` (the
    `learning_rate` the run had); if `config.learning_rate` differs, scale them to it (the backoff still applies).
    Returns the configured learning rate."""
    configured = config.learning_rate
    if saved and configured and configured != saved:
        scale_learning_rate(optimizer, scheduler, configured / saved)
    return configured


def scale_learning_rate(optimizer: Any, scheduler: Any, factor: float) -> float:
    """Multiply the current and scheduled learning rates by `factor`; return the new learning rate of group 0."""
    for group in param_groups(optimizer):
        group["lr"] = group["lr"] * factor
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps the torch one
    if inner is not None and hasattr(inner, "base_lrs"):
        inner.base_lrs = [lr * factor for lr in inner.base_lrs]
        if hasattr(inner, "_last_lr"):
            inner._last_lr = [g["lr"] for g in param_groups(optimizer)]
    groups = param_groups(optimizer)
    return groups[0]["lr"] if groups else float("nan")


def undo_backoff(optimizer: Any, lr_scale: float) -> None:
    """Take a previous run's backoff (`lr_scale`, the product of its factors) off `optimizer`'s learning rates."""
    if optimizer is not None and lr_scale != 1.0:
        scale_learning_rate(optimizer, None, 1.0 / lr_scale)


def record_end_restore(
    port: GuardPort, source: RollbackSource, events: EventLog, best: str | None, damaged_ranks: list[int]
) -> Restored:
    """When training has ended with a state damaged after the guard's last check (a callback later in the list, at
    the last `on_step_end` or at `on_train_end`): put back the last good state, so that `save_model()` writes a finite
    model. `best`: the best checkpoint the caller loaded (`load_best_model_at_end`: it is what the run ends with; a
    damaged parameter it does not hold, a LoRA base, is repaired from its files or stops the run), else the last
    good state of `source`. No backoff and no counter: training is over. Records a `restore` event."""
    state = port.state
    step = state.global_step
    if best is not None:
        # A PEFT checkpoint holds the adapters only: any parameter still damaged (a frozen base) is repaired from its
        # files or named, as after any restore.
        repair_frozen(port.model, source.checkpoints, step, held=())
        restored = Restored(state.best_global_step, step, source=best)
    else:
        restored = Restored(source.restore(state).step, step)
    detail = {"restored_from": restored.source, "restored_step": restored.step, "reason": "damaged_after_last_check"}
    events.add(RunEvent(step, "restore", ["weights_or_optimizer_state"], list(damaged_ranks), detail))
    logger.warning(
        f"NaN guard: the weights or optimizer state became non-finite after the last check of step {step} (a "
        f"callback after the guard's?); restored the last good state ({restored.source}, step {restored.step}) so the "
        "final model is finite."
    )
    return restored


__all__ = [
    "Restored",
    "follow_learning_rate",
    "record_end_restore",
    "restore_last_good",
    "scale_learning_rate",
    "undo_backoff",
]
