"""`NanGuardCallback`: the guard's part of the trainer's loop events."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from . import inspection


class NanGuardCallback(TrainerCallback):
    """Takes the first snapshot at train start, hands the skip flag to the optimizer before each step (and takes it
    back after it), and inspects the recent steps (skip, roll back, snapshot) at the end of each step and epoch, after
    the Trainer's flow callback decided whether this step logs, evaluates, saves or ends training, and before it does
    any of them.

    Args:
        trainer: the safe trainer whose run's guard this drives (`trainer.safe_run`).
    """

    priority = 20  # see `run.py`: after the step record's, before the watchdog's

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs: Any):
        inspection.begin(self.trainer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs: Any):
        self.trainer.safe_run.guard.apply_skip()  # the optimizer the guard bound to at `on_train_begin`

    def on_optimizer_step(self, args, state, control, **kwargs: Any):
        self.trainer.safe_run.guard.after_update()

    def on_step_end(self, args, state, control, **kwargs: Any):
        self._at_boundary(control)

    def on_epoch_end(self, args, state, control, **kwargs: Any):
        self._at_boundary(control)

    def on_train_end(self, args, state, control, **kwargs: Any):
        inspection.inspect(self.trainer)

    def _at_boundary(self, control: Any) -> None:
        due = self.trainer.safe_run.guard.due(control)
        if due is not None:
            verify, snapshot = due
            inspection.inspect(self.trainer, verify=verify, snapshot=snapshot)
