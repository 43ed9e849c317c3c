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
the next save (at most one in flight), the end of training, the best model's load, a preemption's exit.
"""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import CallbackHandler

from ..restarts.background_save import BackgroundSaves


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


def saves_in_background(trainer: Any, publishes: bool) -> bool:
    """Whether this save is written in the background: `save_in_background=True`, one process that publishes, and
    neither DeepSpeed nor FSDP (whose engines write their own sharded state; see `docs/guard.md`)."""
    run = trainer.safe_run
    return (
        run.saves is not None
        and publishes
        and trainer.args.world_size == 1
        and not trainer.is_deepspeed_enabled
        and not trainer.is_fsdp_enabled
    )


def announce(trainer: Any) -> None:
    """Wait for the save in flight, if any, and tell its readers (main thread): the guard, the step record, the hub
    upload, the rotation, then `on_save` with the state as saved. Raises [`CheckpointWriteError`] when it failed."""
    saves = trainer.safe_run.saves
    pending = saves.wait() if saves is not None else None
    if pending is None:
        return
    trainer._after_published(pending.final, pending.run_dir, pending.step, publishes=True)
    if pending.on_save_due:
        due = trainer.control.should_save  # this step's own save, if any, still happens (`on_save` clears it)
        handler = trainer.callback_handler
        trainer.control = CallbackHandler.on_save(handler, trainer.args, pending.state, trainer.control)
        trainer.control.should_save = trainer.control.should_save or due


def announce_if_written(trainer: Any) -> None:
    """At a step boundary: tell the readers of a save the writer has finished (never waits for one in flight)."""
    saves = trainer.safe_run.saves
    if saves is not None and saves.in_flight and saves.done():
        announce(trainer)


def training_stops_here(trainer: Any) -> bool:
    """Whether the loop ends after this step boundary (the last step, a stop a callback asked for, a preemption's
    stopping step): a save in flight is published and announced before anything after it reads a checkpoint."""
    state, preemption = trainer.state, trainer.safe_run.preemption
    stopping = preemption is not None and preemption.stopping_at == state.global_step
    return stopping or trainer.control.should_training_stop or state.global_step >= state.max_steps


__all__ = ["SaveAwareCallbackHandler", "announce", "announce_if_written", "saves_in_background", "training_stops_here"]
