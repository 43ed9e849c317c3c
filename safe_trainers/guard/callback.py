"""`NanGuardCallback`: connects a [`NanGuard`] to the trainer's loop events."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from .guard import NanGuard


class NanGuardCallback(TrainerCallback):
    """Takes the first snapshot at train start, hands the skip flag to the optimizer before each step (and takes it
    back after it), and inspects the recent steps (skip, roll back, snapshot) at the end of each step and epoch, after
    the Trainer's flow callback decided whether this step logs, evaluates, saves or ends training, and before it does
    any of them.
    """

    def __init__(self, guard: NanGuard):
        self.guard = guard

    def on_train_begin(self, args, state, control, **kwargs: Any):
        self.guard.begin()

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs: Any):
        self.guard.apply_skip(optimizer if optimizer is not None else self.guard.trainer.optimizer)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs: Any):
        self.guard.flags.after_update(optimizer if optimizer is not None else self.guard.trainer.optimizer)

    def on_step_end(self, args, state, control, **kwargs: Any):
        self.guard.at_boundary(control)

    def on_epoch_end(self, args, state, control, **kwargs: Any):
        self.guard.at_boundary(control)

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.guard.inspect(control)
