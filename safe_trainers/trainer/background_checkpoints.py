"""Where background saves (`restarts/background_save.py`) meet the Trainer: which saves go to the background, and
when the readers of a checkpoint written there are told, always on the main thread and only once it is published.

The readers of a checkpoint, and when each sees one written in the background (`docs/guard.md`, "Checkpoints"):

* `on_save` callbacks and integrations (W&B/MLflow artifacts read `checkpoint-{state.global_step}`): the Trainer
  calls `on_save` right after `_save_checkpoint` returns, when the files are not written yet; the run's callback
  handler ([`SaveAwareCallbackHandler`]) holds that call back and makes it once the checkpoint is published, with the
  `TrainerState` as it was saved (its `global_step` is the checkpoint's);
* the hub upload (`hub_strategy="checkpoint"`), the `save_total_limit` rotation (only after a publication, so never
  the checkpoint in flight, and never the best one) and the restarts' step record (`run.progress.published`): once
  published, in the order a synchronous save runs them ([`CheckpointHooks._after_published`]);
* the guard's rollback source (`nan_rollback_from="checkpoint"`, frozen parameters): once published;
* `trainer_state.json`'s `best_model_checkpoint`: written with the published path at the save, as synchronously;
* `load_best_model_at_end` and `train()`'s return: the save in flight is published and announced first;
* a preemption's exit (status 75): the save of the stopping step is published and announced first;
* `resume_from_checkpoint=True` and a restart: only published checkpoints are listed; a crash during a background
  write leaves an unsealed staged copy that the next start removes.

The readers are told at the first of: the next step boundary after the writer finished (a check that never waits),
the next save (at most one in flight), any rollback (the restored best-model fields may name it), the end of
training, the best model's load, a preemption's exit.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.trainer_callback import CallbackHandler

from ..restarts.background_save import BackgroundSaves, CheckpointWriteError
from ..restarts.output_lock import publishes_here
from ..rules.memory import save_strategy
from ..runtime.collectives import distributed, max_across_ranks, ranks_with_flag
from ..runtime.host_staging import prepare_staging
from ..runtime.saved_weights import written_part

logger = logging.getLogger("safe_trainers")


class SaveAwareCallbackHandler(CallbackHandler):
    """transformers' callback handler, except that `on_save` for a checkpoint still being written in the background
    is made once it is published ([`announce`]).

    Args:
        saves ([`BackgroundSaves`]): the run's writer.
    """

    saves: BackgroundSaves | None = None

    @classmethod
    def taking_over(cls, handler: CallbackHandler, saves: BackgroundSaves) -> SaveAwareCallbackHandler:
        """The same handler (its callbacks, model, optimizer, dataloaders), with `on_save` held back for `saves`."""
        aware = cls.__new__(cls)
        aware.__dict__.update(handler.__dict__)
        aware.saves = saves
        return aware

    def on_save(self, args: Any, state: Any, control: Any) -> Any:
        pending = self.saves.pending if self.saves is not None else None
        if pending is not None and pending.step == state.global_step and not pending.on_save_due:
            pending.on_save_due = True  # made by `announce`, once the checkpoint is published
            control.should_save = False  # this save is done, as the Trainer's own `on_save` would say
            return control
        return super().on_save(args, state, control)


def saves_in_background(trainer: Any) -> bool:
    """Whether the saves of this run are written in the background: `save_in_background=True` (agreed across ranks
    at [`train_began`]), neither DeepSpeed nor FSDP (whose engines write their own sharded state; see
    `docs/guard.md`). The same answer on every rank."""
    return trainer.safe_run.saves is not None and not trainer.is_deepspeed_enabled and not trainer.is_fsdp_enabled


def train_began(trainer: Any) -> None:
    """`train()` begins: under several ranks, background saves stay on only if they are on for every rank (a rule
    may turn them off where a node lacks the host memory), since a save's collectives depend on it."""
    run = trainer.safe_run
    if run.writers is not None:
        run.writers.train_began()
    if distributed():
        off = torch.tensor([float(run.saves is None)], device=trainer.accelerator.device)
        if bool(max_across_ranks(off)[0] > 0) and run.saves is not None:
            logger.warning("Background saves are off on another rank: every rank writes its checkpoints in line.")
            run.saves = trainer.callback_handler.saves = run.writers.saves = None


def announce(trainer: Any) -> None:
    """Wait for the save in flight, if any, and tell its readers (main thread): the guard, the step record, the hub
    upload, the rotation, then `on_save` with the state as saved. Raises [`CheckpointWriteError`] when it failed, on
    every rank when it failed on one (every rank has the same save in flight and calls this at the same point)."""
    saves = trainer.safe_run.saves
    if saves is None or not saves.in_flight:
        return
    with trainer.safe_run.guard.clock.paused():  # a write (and an upload) may take minutes: never a (hung) step
        _announce(trainer, saves)


def _announce(trainer: Any, saves: BackgroundSaves) -> None:
    step, error = saves.pending.step, None
    try:
        pending = saves.wait()
    except CheckpointWriteError as failed:
        pending, error = None, failed
    failed_on = ranks_with_flag(torch.tensor([error is not None], device=trainer.accelerator.device))[0]
    if failed_on and error is None:  # under several ranks: it failed on another
        raise CheckpointWriteError(
            f"The background save of checkpoint-{step} failed on rank {failed_on[0]} and was not published (its "
            "error is in that rank's log). The previous checkpoint stands. Set `save_in_background=False` to write "
            "checkpoints on the training thread."
        )
    if error is not None:
        raise error
    trainer._after_published(
        pending.final, pending.run_dir, pending.step, pending.publishes, pending.uploads, saved_state=pending.state
    )
    if pending.on_save_due:
        due = trainer.control.should_save  # this step's own save, if any, still happens (`on_save` clears it)
        handler = trainer.callback_handler
        trainer.control = CallbackHandler.on_save(handler, trainer.args, pending.state, trainer.control)
        trainer.control.should_save = trainer.control.should_save or due


def announce_on_error(trainer: Any) -> None:
    """`train()` is left by an exception with a save in flight: in one process, its writer finishes (publishing it,
    or not on a write error) and its readers are told, as they would have been before the failing step with a
    synchronous save; a failure here is logged, never raised over the exception on its way out. Under several ranks
    nothing is told (that needs a collective, and the other ranks may be gone): the checkpoint is published and in
    the step record, so a restart resumes from it, but `on_save`, the upload and the rotation of it do not run."""
    saves = trainer.safe_run.saves
    if saves is None or not saves.in_flight or distributed():
        return
    step = saves.pending.step
    try:
        announce(trainer)
    except Exception as error:  # the original exception is the one to see
        logger.error(f"The background save of checkpoint-{step} was not announced to its readers: {error}")


def announce_if_written(trainer: Any) -> None:
    """At a step boundary: tell the readers of a save every rank's writer has finished (never waits for one in
    flight; under several ranks, known from the bits the guard's all-reduce agreed, `restarts/writers_done.py`)."""
    run = trainer.safe_run
    saves = run.saves
    if saves is None:
        return
    if distributed():
        written = run.writers is not None and run.writers.all_done(trainer.state.global_step)
    else:
        written = saves.in_flight and saves.done()
    if written:
        announce(trainer)


def prepare_buffers(trainer: Any) -> None:
    """After the first optimizer step of a run that saves (the optimizer's moments exist): allocate the host buffers
    of the background save on a thread, so that the first save blocks only for its copy, as every later one
    (`HostBuffers.prepare`). Once; on the ranks that write."""
    run = trainer.safe_run
    saves = run.saves
    if saves is None or saves.buffers.prepared or trainer.state.global_step < 1 or not saves_in_background(trainer):
        return
    saves.buffers.prepared = True
    if not saves_before_the_end(trainer.args, trainer.state) or not publishes_here(trainer.args, run.output_lock):
        return
    weights = written_part(trainer.model, trainer.model.state_dict())
    if weights is not None:  # else written on the training thread (prompt-learning PEFT)
        prepare_staging(weights, saves.buffers.model)
    if not trainer.args.save_only_model:
        prepare_staging(trainer.optimizer.state_dict(), saves.buffers.optimizer)


def saves_before_the_end(args: Any, state: Any) -> bool:
    """Whether the Trainer's schedule may save before the run's last step: only such a save is written in the
    background (the last one is written in line, `CheckpointHooks._save_checkpoint`), so only then are the host
    buffers prepared. `"best"` saves whenever the metric improves; an unknown strategy is taken to save. A save a
    callback asks for off this schedule still goes to the background, its buffers allocated on its own path."""
    before_the_end = {
        "no": False,
        "steps": bool(state.save_steps) and state.save_steps < state.max_steps,
        "epoch": state.num_train_epochs > 1,
    }
    return before_the_end.get(save_strategy(args), True)


def training_stops_here(trainer: Any) -> bool:
    """Whether the loop ends after this step boundary (the last step, a stop a callback asked for, a preemption's
    stopping step): a save in flight is published and announced before anything after it reads a checkpoint."""
    state, preemption = trainer.state, trainer.safe_run.preemption
    stopping = preemption is not None and preemption.stopping_at == state.global_step
    return stopping or trainer.control.should_training_stop or state.global_step >= state.max_steps


__all__ = [
    "SaveAwareCallbackHandler", "announce", "announce_if_written", "announce_on_error", "prepare_buffers",
    "saves_before_the_end", "saves_in_background", "train_began", "training_stops_here",
]  # fmt: skip
