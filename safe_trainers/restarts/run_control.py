"""Wires preemption handling and hang detection into a guarded trainer (see `preemption.py` and `watchdog.py`).

Both are part of the NaN guard (`nan_guard=True`): preemption rides on the guard's per-step all-reduce and saves
through its verified, staged `_save_checkpoint`, and the watchdog's exits are deaths in the guard's step record. With
`nan_guard=False` signals keep their default handling and no step is timed.

Callback order, right after transformers' flow callback: [`PreemptionCallback`] (decides at `on_step_end` whether
this step is the one every rank stops at, and asks it to save, before the guard verifies), the step record, the
guard, then [`HangWatchdog`] (its `on_step_end` comes after the guard's inspection, so the inspection's collectives
are timed with the step). [`CompileWatch`] (anywhere in the list) tells the step record and the watchdog when torch
compiles (see `compile_watch.py`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers.trainer_callback import DefaultFlowCallback

from ..guard.callback import NanGuardCallback
from ..guard.checkpoint_dirs import checkpoint_step
from ..guard.collectives import ranks_with_flag
from ..guard.events import NanEvent
from .compile_watch import CompileWatch
from .hang_report import hang_exits
from .preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionCallback, parse_signals
from .resume_plan import restart_count
from .watchdog import HangWatchdog, generation_period

logger = logging.getLogger("safe_trainers")


def attach_run_control(trainer: Any, settings: Any) -> None:
    """Add the preemption callback (with `preempt_signals`), the hang watchdog (with `hang_timeout > 0`) and the
    compile watch to a trainer whose guard and step record are already in its callback list."""
    guard = trainer.nan_guard
    callbacks = trainer.callback_handler.callbacks
    signals = parse_signals(settings.preempt_signals)
    if signals:
        trainer.preemption = guard.preemption = PreemptionCallback(guard, signals)
        flow = next((i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)), -1)
        callbacks.insert(flow + 1, trainer.preemption)
    listeners: list[Any] = [trainer.step_progress]
    if settings.hang_timeout > 0:
        args = trainer.args
        watchdog = HangWatchdog(
            args.output_dir, args.process_index, settings.hang_timeout, settings.hang_timeout_factor,
            attempt=restart_count(os.environ), learn_after=generation_period(args),
            exits=hang_exits(settings.hang_action, os.environ), action=settings.hang_action,
            on_hang=lambda step, detail: guard.events.add(NanEvent(step, "hang", [], [args.process_index], detail)),
        )  # fmt: skip
        trainer.hang_watchdog = guard.watchdog = watchdog
        at = next(i for i, cb in enumerate(callbacks) if isinstance(cb, NanGuardCallback))
        callbacks.insert(at + 1, watchdog)
        listeners.append(watchdog)
    trainer.compile_watch = CompileWatch(listeners)
    callbacks.append(trainer.compile_watch)


def after_boundary(trainer: Any) -> None:
    """After a step's log, evaluation and save: exit if this is the step the ranks stop at for a preemption (unless
    it is the last step: training then ends as usual, and `train()` exits after it)."""
    preemption = getattr(trainer, "preemption", None)
    if preemption is not None and trainer.state.global_step < trainer.state.max_steps:
        preemption.exit_if_stopping(trainer.state)


def after_train(trainer: Any) -> None:
    """When `train()` leaves, by a return or an exception: the signal handlers go back, the compile hooks are removed
    and the watchdog stops."""
    if getattr(trainer, "compile_watch", None) is not None:
        trainer.compile_watch.unregister()
    if getattr(trainer, "hang_watchdog", None) is not None:
        trainer.hang_watchdog.stop()
    if getattr(trainer, "preemption", None) is not None:
        trainer.preemption.restore()


def preempted_at_end(trainer: Any) -> Preempted | None:
    """After a run that finished although a preemption was asked for (a signal during the last step, or after it
    while training ended): the job was asked to end, so the process exits as preempted (status 75) all the same, but
    the finished state is kept first. The ranks agree whether any of them was signalled (one collective per
    `train()` call: under several ranks a signal to one rank during the last step is known to that rank only), and if
    the last step has no checkpoint yet (`save_strategy="no"`, a step off the save interval; a call that resumed from
    the final checkpoint and trained nothing has one) it is published now, so the restart (or
    `resume_from_checkpoint=True`) loads the finished state and trains no step. Returns the exit to raise once the
    step record has recorded the finished call, or `None`."""
    preemption = getattr(trainer, "preemption", None)
    if preemption is None:
        return None
    asked = preemption.received is not None or preemption.stopping_at is not None
    ranks = ranks_with_flag(torch.tensor([asked], device=trainer.args.device))[0]
    if not ranks:
        return None
    step = trainer.state.global_step
    hooks = trainer.hooks_ran
    saved = hooks.steps.get("_save_checkpoint") == step and hooks.refused_save != step
    if not saved and checkpoint_step(trainer.nan_guard.resumed_from or "") != step:  # not resumed at the end either
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)  # verified and staged like every checkpoint
    name = preemption.received.name if preemption.received is not None else "a signal on another rank"
    detail = {"signal": name, "received_step": preemption.received_step, "checkpoint_step": step, "finished": True}
    trainer.nan_guard.events.add(NanEvent(step, "preempt", [], ranks, detail))
    if trainer.is_world_process_zero():
        logger.warning(
            f"Preempted ({name}) after the last step: the run finished, checkpoint-{step} holds its final state; "
            f"exiting with status {PREEMPTED_EXIT_CODE}. A restart by the elastic agent, or "
            "`train(resume_from_checkpoint=True)`, returns the finished state without training a step."
        )
    return Preempted(step, name)


__all__ = ["after_boundary", "after_train", "attach_run_control", "preempted_at_end"]
