"""Where preemption and hang detection act on the trainer's `train()` call (see `restarts/preemption.py` and
`restarts/watchdog.py`; they are built and their callbacks installed with the run, `run.py`).

Both are part of the NaN guard (`nan_guard=True`): preemption rides on the guard's per-step all-reduce and saves
through its verified, staged `_save_checkpoint`, and the watchdog's exits are deaths in the step record. With
`nan_guard=False` signals keep their default handling and no step is timed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..restarts.preemption import PREEMPTED_EXIT_CODE, Preempted
from ..runtime.checkpoint_dirs import checkpoint_step
from ..runtime.collectives import ranks_with_flag
from ..runtime.events import RunEvent
from .background_checkpoints import announce

logger = logging.getLogger("safe_trainers")


def after_boundary(trainer: Any) -> None:
    """After a step's log, evaluation and save: exit if this is the step the ranks stop at for a preemption (unless
    it is the last step: training then ends as usual, and `train()` exits after it)."""
    preemption = trainer.safe_run.preemption
    if preemption is not None and trainer.state.global_step < trainer.state.max_steps:
        preemption.exit_if_stopping(trainer.state, trainer.args.device)


def after_train(trainer: Any) -> None:
    """When `train()` leaves, by a return or an exception: the signal handlers go back, the compile hooks are removed,
    the watchdog stops and the hangs other ranks relayed on the all-reduces already agreed are recorded (left by an
    exception, no `on_train_end` read them: `restarts/hang_relay.py`)."""
    run = trainer.safe_run
    if run.compile_watch is not None:
        run.compile_watch.unregister()
    if run.watchdog is not None:
        run.watchdog.stop()
    if run.hang_relay is not None:
        try:
            run.hang_relay.train_left()
        except Exception as error:  # never in the way of the exception `train()` is leaving with
            logger.warning(f"NaN guard: the hangs relayed from other ranks were not all recorded: {error!r}")
    if run.preemption is not None:
        run.preemption.restore()


def preempted_at_end(trainer: Any) -> Preempted | None:
    """After a run that finished although a preemption was asked for (a signal during the last step, or after it
    while training ended): the job was asked to end, so the process exits as preempted (status 75) all the same, but
    the finished state is kept first. The ranks agree whether any of them was signalled (one collective per
    `train()` call: under several ranks a signal to one rank during the last step is known to that rank only), and if
    the last step has no checkpoint yet (`save_strategy="no"`, a step off the save interval; a call that resumed from
    the final checkpoint and trained nothing has one) it is published now, so the restart (or
    `resume_from_checkpoint=True`) loads the finished state and trains no step. Returns the exit to raise once the
    step record has recorded the finished call, or `None`."""
    run = trainer.safe_run
    preemption = run.preemption
    if preemption is None:
        return None
    asked = preemption.requested not in (None, "deadline") or preemption.stopping_at is not None  # a deadline: done
    ranks = ranks_with_flag(torch.tensor([asked], device=trainer.args.device))[0]
    if not ranks:
        return None
    step = trainer.state.global_step
    hooks = run.hooks_ran
    saved = hooks.steps.get("_save_checkpoint") == step and hooks.refused_save != step
    if not saved and checkpoint_step(run.guard.resumed_from or "") != step:  # not resumed at the end either
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)  # verified and staged like every checkpoint
        announce(trainer)  # published (a background save) before the process exits
    name = preemption.requested if preemption.requested is not None else "a signal on another rank"
    detail = {"signal": name, "received_step": preemption.received_step, "checkpoint_step": step, "finished": True}
    run.events.add(RunEvent(step, "preempt", [], ranks, detail))
    if trainer.is_world_process_zero():
        logger.warning(
            f"Preempted ({name}) after the last step: the run finished, checkpoint-{step} holds its final state; "
            f"exiting with status {PREEMPTED_EXIT_CODE}. A restart by the elastic agent, or "
            "`train(resume_from_checkpoint=True)`, returns the finished state without training a step."
        )
    return Preempted(step, name)


__all__ = ["after_boundary", "after_train", "preempted_at_end"]
