"""The learning-rate backoff after a rollback: the current and the scheduled learning rates, scaled together.

A rollback multiplies the learning rate by `nan_lr_backoff`; the factor is kept with the guard's state
(`GuardState.lr_scale`), comes back with a checkpoint's optimizer and scheduler, and is undone when a new run starts on
the same trainer.
"""

from __future__ import annotations

from typing import Any

from .good_state import param_groups


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


__all__ = ["scale_learning_rate", "undo_backoff"]
