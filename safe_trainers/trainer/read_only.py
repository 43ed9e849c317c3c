"""Whether a verification of the state outlives the callbacks that run after it: when every callback of the trainer
is one that cannot change the weights or the optimizer state (transformers' flow, progress and printer callbacks, the
reporting integrations, the run's own), the state the guard verified at a step is the state every later boundary of
that step, a save there and the end of `train()` see. The guard then checks the last step once (`on_step_end`), not
again at `on_epoch_end`, before a save of the same step, and when `train()` returns; and does not copy it (no step is
left that a rollback would undo).

Any other callback (a user's, TRL's reference-model sync, weight averaging) may change the state after the guard's
check, so every one of those checks stays (`tests/guard/test_damage_after_the_last_check.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers.trainer_callback import (
    DefaultFlowCallback, EarlyStoppingCallback, PrinterCallback, ProgressCallback,
)  # fmt: skip

from ..runtime.collectives import ranks_with_flag


# transformers' callbacks that only set the loop's flags or print; the run's own declare `leaves_state_alone = True`.
READ_ONLY_CALLBACKS: tuple[type, ...] = (DefaultFlowCallback, EarlyStoppingCallback, PrinterCallback, ProgressCallback)
# The reporting integrations (TensorBoard, W&B, MLflow, ...): they log what the Trainer hands them.
READ_ONLY_MODULES: tuple[str, ...] = ("transformers.integrations.integration_utils",)


def leaves_state_alone(callback: Any) -> bool:
    """Whether `callback` cannot change the weights or the optimizer state: one of [`READ_ONLY_CALLBACKS`] (the exact
    class, not a subclass), a reporting integration, or a class that declares `leaves_state_alone = True` itself."""
    cls = type(callback)
    return cls in READ_ONLY_CALLBACKS or cls.__module__ in READ_ONLY_MODULES or vars(cls).get("leaves_state_alone")


def callbacks_read_only(callbacks: Iterable[Any], device: torch.device | None = None) -> bool:
    """Whether every callback on every rank leaves the state alone (a collective: a rank with a callback of its own
    keeps the checks, and so do all the others, which take part in them)."""
    local = all(leaves_state_alone(callback) for callback in callbacks)
    return not ranks_with_flag(torch.tensor([not local], device=device))[0]


def due_unless_settled(guard: Any, control: Any, last: bool = False) -> tuple[bool, bool] | None:
    """`guard.due(control)` for a run whose callbacks all leave the state alone: the verification of this step stands
    (`due` drops it, for callbacks that may change the state), and nothing is due when the guard has nothing left
    to do at this step: no step waits to be judged, the state was verified at it and the snapshot kept is its own
    (or, at the `last` step, where no snapshot is taken, whichever it is)."""
    verified = guard.verified_step
    due = guard.due(control)
    guard.verified_step = verified
    step, snapshot = guard.port.state.global_step, getattr(guard.snapshotter, "snapshot", None)
    current = snapshot is not None and (snapshot.step == step or last)
    settled = current and not guard.flags.pending and verified == step
    return None if settled else due


__all__ = ["READ_ONLY_CALLBACKS", "callbacks_read_only", "due_unless_settled", "leaves_state_alone"]
