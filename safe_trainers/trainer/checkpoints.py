"""Where the NaN guard meets the Trainer's checkpoints: written to a staging directory, verified finite, published by
renames (`restarts/publishing.py`), uploaded and rotated only once published; `save_model` refuses non-finite weights.
The contracts each keeps are listed in `hooks.py`."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME

from ..errors import NonFiniteWeightsError
from ..guard import refuse_save
from ..restarts.output_lock import publishes_here
from ..restarts.publishing import publish
from ..restarts.rotation import rotate_up_to
from ..runtime.checkpoint_dirs import STAGING_DIR, checked_staging, checkpoint_dir, staging_run_dir
from ..runtime.finite import all_finite
from .hooks_ran import verify_hooks
from .run import SafeRun


class CheckpointHooks:
    """The checkpoint half of [`NanGuardTrainerMixin`] (mixed in before a `transformers.Trainer` subclass)."""

    safe_run: SafeRun

    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        run = self.safe_run
        if run.guard is None or not run.hooks.staging:
            return run_dir
        run.hooks_ran.ran("_get_output_dir", self.state.global_step)  # the Trainer's save asked where to write
        return staging_run_dir(run_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        run = self.safe_run
        if run.guard is None or not run.hooks.staging:  # uploaded once published (see `_save_checkpoint`)
            super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint to a staging directory, then rename it: never half-written, never non-finite."""
        run = self.safe_run
        guard = run.guard
        if guard is None:
            return super()._save_checkpoint(model, trial)
        step = self.state.global_step
        run.hooks_ran.ran("_save_checkpoint", step)
        if not guard.state_verified():
            refuse_save(run.events, step)  # not reached from the training loop, which restores a damaged state first
            run.hooks_ran.refused_save = step
            return
        run_dir = self._get_output_dir(trial)
        staged, final = checkpoint_dir(staging_run_dir(run_dir), step), checkpoint_dir(run_dir, step)
        checked_staging(run_dir, create=True)  # a real directory of this user's, never a link
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # no rotation inside staging: ours below
        run.hooks.staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            run.hooks.staging = False
            self.args.save_total_limit = limit
        verify_hooks(self, "save")  # the Trainer wrote to the staging directory, or the run stops here
        self.state.best_model_checkpoint = _published_best(self.state, run_dir, step)
        self.accelerator.wait_for_everyone()
        publishes = publishes_here(self.args, run.output_lock)
        if publishes:  # one process per storage: never a node sharing rank 0's (`save_on_each_node`)
            self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))  # with the published best path
            if os.path.isfile(os.path.join(staged, TRAINING_ARGS_NAME)):  # saved with `save_total_limit=None`
                torch.save(self.args, os.path.join(staged, TRAINING_ARGS_NAME))
            guard.state.save(staged, guard.spikes)  # with the spike window
            publish(staged, final)
        guard.published(final)
        self.accelerator.wait_for_everyone()
        run.progress.published(run_dir, step)  # before the upload and the rotation: a kill there keeps it resumable
        if self.args.push_to_hub and not run.hooks.starting_checkpoint:
            self._push_from_checkpoint(final)
        if publishes:
            rotate_up_to(run_dir, step, self.args.save_total_limit, self.state.best_model_checkpoint)
        run.progress.published(run_dir, step)  # again, without the checkpoints the rotation removed

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.safe_run.guard is not None and self.args.should_save:
            tensors = state_dict if state_dict is not None else self.model.state_dict()
            if not bool(all_finite(tensors.values())):
                bad = [k for k, t in tensors.items() if not bool(all_finite([t]))]
                raise NonFiniteWeightsError(output_dir or self.args.output_dir, bad[:10])
        super()._save(output_dir, state_dict=state_dict)


def _published_best(state: Any, run_dir: str, step: int) -> str | None:
    """The best checkpoint as a published path: the Trainer computed it inside the staging directory."""
    if state.best_global_step:
        path = checkpoint_dir(run_dir, state.best_global_step)
        if state.best_global_step == step or os.path.isdir(path):
            return path
    current = state.best_model_checkpoint
    if current and STAGING_DIR not in current and os.path.isdir(current):
        return current
    return None
