"""The guard's inspections carried out on a trainer: the guard judges and decides, this module does what only the
trainer can (replay a faulted step, load the last good checkpoint, publish a good state, save the abort checkpoint,
drop GRPO/RLOO's buffered rollouts) and calls the guard's next door. The guard never calls back.

One inspection, as the code runs it: [`inspect`] -> `NanGuard.judge` (read the flags, judge them) -> `replay.diagnose`
(when the guard hands back a faulted step's batches) -> `replay_bundles.write_bundles` (the faulted steps' replay
bundles, before any restore) -> `NanGuard.settle` (record, decide) -> [`carry_out`]: for a
rollback `checkpoint_rollback.load_good_checkpoint` (the disk source) then `NanGuard.restore`; for a stop the abort
checkpoint then `NanGuard.diverged`; for a disk source's first good state the starting checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..guard import Decision, Verdict, rollback_source
from ..runtime.checkpoint_dirs import checkpoint_dir
from . import background_checkpoints
from .background_checkpoints import announce
from .checkpoint_rollback import load_good_checkpoint
from .port import training_backend
from .read_only import callbacks_read_only
from .replay import diagnose
from .replay_bundles import write_bundles

logger = logging.getLogger("safe_trainers")


def begin(trainer: Any) -> None:
    """Training starts (`on_train_begin`): the guard binds to the backend and keeps its first good state."""
    run = trainer.safe_run
    run.port.bind(trainer)  # the state, the model and the scheduler of this `train()` call
    background_checkpoints.train_began(trainer)  # before the starting checkpoint, which may be written in background
    run.callbacks_read_only = callbacks_read_only(trainer.callback_handler.callbacks, trainer.args.device)
    rollback_from, note = rollback_source(trainer.safety_settings, trainer.args, trainer.safety_report)
    if note is not None and trainer.is_world_process_zero():
        logger.warning(note)  # the config and the guard disagree: said, with the rule that decided
    if run.guard.begin(training_backend(trainer), rollback_from):
        publish_good_state(trainer)


def inspect(trainer: Any, verify: bool = False, snapshot: bool = False, fresh: bool = False) -> Verdict | None:
    """Judge the pending steps (and the state, with `verify`), replay a faulted step for its diagnosis, and carry out
    what the guard decides. Returns the verdict, or `None` when there was nothing to judge."""
    run = trainer.safe_run
    guard = run.guard
    judged = guard.judge(verify=verify, snapshot=snapshot, fresh=fresh)
    if judged is None:
        return None
    diagnosis = None
    if judged.replay:
        with guard.clock.paused():  # a replay of the step's micro-batches: not timed with the step
            diagnosis = diagnose(trainer, judged.replay, judged.replay_step)
    if judged.verdict.rollback is not None:
        # A rollback sees the checkpoint a background save is writing as published: the disk source may load it, and
        # the restored best-model fields may name it (a best checkpoint that is not there is dropped).
        announce(trainer)
    if judged.bundles:
        with guard.clock.paused():  # the faulted steps' replay bundles, before anything is restored: not timed
            write_bundles(trainer, judged, diagnosis)
    decision = guard.settle(judged, diagnosis)
    carry_out(trainer, decision)
    return decision.verdict


def unsnapshotted(trainer: Any) -> bool:
    """Whether the state the Trainer is about to save or evaluate has no snapshot of this step: a callback after the
    guard's asked for the save or evaluation, which the guard's inspection did not see. It is then taken with the
    check (every save and evaluation is a snapshot; not after a skipped step, `NanGuard.settle`). Not when a rollback
    at this step put the kept snapshot back (the live state is that snapshot: a copy would only relabel it). A run
    whose callbacks all leave the state alone asks for none after the guard's (`read_only.py`)."""
    run = trainer.safe_run
    kept = getattr(run.guard.snapshotter, "snapshot", None)
    step = trainer.state.global_step
    return not run.callbacks_read_only and kept is not None and step not in (kept.step, kept.restored_at)


def carry_out(trainer: Any, decision: Decision) -> None:
    """Do what an inspection decided: restore the last good state (and stop, for an abort), or publish the disk
    source's first good state."""
    guard = trainer.safe_run.guard
    saves = trainer.safe_run.saves
    # A save still being written in the background is of an earlier good state: it is that state (published before
    # any rollback loads, `inspect`), or the run stops on its write error.
    if decision.publish_good_state and not (saves is not None and saves.in_flight):
        publish_good_state(trainer)
    if not decision.restore:
        return
    if decision.load is not None:
        before_write(trainer)  # a DDP rank without its shard loads from disk: its side-stream copies land first
        with guard.clock.paused():  # a whole checkpoint from disk
            load_good_checkpoint(trainer, decision.load, guard.backend)
    restored = guard.restore(decision)
    discard = getattr(trainer, "discard_rollouts", None)
    if discard is not None:
        discard()  # GRPO/RLOO: completions sampled by the discarded policy
    if decision.abort:
        with guard.clock.paused():  # the checkpoint's save is not timed with the step (a hang would restart it)
            checkpoint = save_abort_checkpoint(trainer, restored.at_step)
        raise guard.diverged(decision, restored, checkpoint)


def finish(trainer: Any) -> None:
    """When `train()` returns, after every callback of the last step and of `on_train_end`: verify once more (every
    rank) and put the last good state back if something damaged it after the last check."""
    run = trainer.safe_run
    guard = run.guard
    if end_check_needless(run, trainer.args, trainer.state.global_step):
        return
    best = trainer.state.best_model_checkpoint
    best = best if trainer.args.load_best_model_at_end and best and os.path.isdir(best) else None
    end = guard.check_at_end(best)
    if end is None:
        return
    with guard.clock.paused():
        if end.best is not None:
            trainer._load_best_model()
        elif end.load is not None:
            before_write(trainer)
            load_good_checkpoint(trainer, end.load, guard.backend)
    guard.restored_at_end(end)


def end_check_needless(run: Any, args: Any, step: int) -> bool:
    """Whether the state `train()` returns is the one verified at its last step: verified at `step`, nothing since
    that could change it (every callback leaves the state alone, no best checkpoint loaded at the end)."""
    return run.callbacks_read_only and run.guard.verified_step == step and not args.load_best_model_at_end


def before_write(trainer: Any) -> None:
    """The weights or the optimizer state are about to be written (the optimizer step, the best model loaded at the
    end, the caller's code once `train()` returns): the last snapshot's copies, if still in flight on their side
    stream, finish first, on the device (`runtime/copy_stream.py`)."""
    snapshotter = trainer.safe_run.guard.snapshotter
    if snapshotter is not None:
        snapshotter.before_write()


def publish_good_state(trainer: Any) -> None:
    """Publish the state training is at as a checkpoint, for `nan_rollback_from="checkpoint"` (verified and staged
    like any checkpoint; not uploaded to the Hub)."""
    hooks = trainer.safe_run.hooks
    hooks.starting_checkpoint = True
    try:
        with trainer.safe_run.guard.clock.paused():
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
    finally:
        hooks.starting_checkpoint = False


def save_abort_checkpoint(trainer: Any, step: int) -> str | None:
    """Save the restored last good state as a checkpoint of `step` (the guard counted the restore and marked the state
    verified); `None` when the save fails: reported, never hiding the divergence behind a save error."""
    try:
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        announce(trainer)  # published, recorded and rotated (a background save) before the run stops
        return checkpoint_dir(trainer._get_output_dir(trial=None), step)
    except Exception as error:
        logger.error(f"NaN guard: could not save the last good state: {error}")
        return None


__all__ = [
    "before_write", "begin", "carry_out", "finish", "inspect", "publish_good_state", "save_abort_checkpoint",
    "unsnapshotted",
]
