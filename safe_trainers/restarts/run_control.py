"""Wires preemption handling and hang detection into a guarded trainer (see `preemption.py` and `watchdog.py`).

Both are part of the NaN guard (`nan_guard=True`): preemption rides on the guard's per-step all-reduce and saves
through its verified, staged `_save_checkpoint`, and the watchdog's exits are deaths in the guard's step record. With
`nan_guard=False` signals keep their default handling and no step is timed.

Callback order, right after transformers' flow callback: [`PreemptionCallback`] (decides at `on_step_end` whether
this step is the one every rank stops at, and asks it to save, before the guard verifies), the step record, the
guard, then [`HangWatchdog`] (its `on_step_end` comes after the guard's inspection, so the inspection's collectives
are timed with the step).
"""

from __future__ import annotations

import os
from typing import Any

from transformers.trainer_callback import DefaultFlowCallback

from ..guard.callback import NanGuardCallback
from .preemption import Preempted, PreemptionCallback, parse_signals
from .resume_plan import restart_count
from .watchdog import HangWatchdog, generation_period


def attach_run_control(trainer: Any, settings: Any) -> None:
    """Add the preemption callback (with `preempt_signals`) and the hang watchdog (with `hang_timeout > 0`) to a
    trainer whose guard and step record are already in its callback list."""
    guard = trainer.nan_guard
    callbacks = trainer.callback_handler.callbacks
    signals = parse_signals(settings.preempt_signals)
    if signals:
        trainer.preemption = guard.preemption = PreemptionCallback(guard, signals)
        flow = next((i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)), -1)
        callbacks.insert(flow + 1, trainer.preemption)
    if settings.hang_timeout > 0:
        args = trainer.args
        watchdog = HangWatchdog(
            args.output_dir, args.process_index, settings.hang_timeout, settings.hang_timeout_factor,
            attempt=restart_count(os.environ), learn_after=generation_period(args),
        )  # fmt: skip
        trainer.hang_watchdog = guard.watchdog = watchdog
        at = next(i for i, cb in enumerate(callbacks) if isinstance(cb, NanGuardCallback))
        callbacks.insert(at + 1, watchdog)


def after_boundary(trainer: Any) -> None:
    """After a step's log, evaluation and save: exit if this is the step the ranks stop at for a preemption (unless
    it is the last step: training then ends as usual, and `train()` exits after it)."""
    preemption = getattr(trainer, "preemption", None)
    if preemption is not None and trainer.state.global_step < trainer.state.max_steps:
        preemption.exit_if_stopping(trainer.state)


def after_train(trainer: Any) -> None:
    """When `train()` leaves, by a return or an exception: the signal handlers go back and the watchdog stops."""
    if getattr(trainer, "hang_watchdog", None) is not None:
        trainer.hang_watchdog.stop()
    if getattr(trainer, "preemption", None) is not None:
        trainer.preemption.restore()


def exit_if_preempted(trainer: Any) -> None:
    """After a run that finished although a preemption was asked for (a signal during the last step, or while
    training ended): the job was asked to end, so the process exits as preempted (status 75) all the same."""
    preemption = getattr(trainer, "preemption", None)
    if preemption is not None and (preemption.received is not None or preemption.stopping_at is not None):
        name = preemption.received.name if preemption.received is not None else "a signal on another rank"
        raise Preempted(trainer.state.global_step, name)


__all__ = ["after_boundary", "after_train", "attach_run_control", "exit_if_preempted"]
