"""Where the NaN guard meets the Trainer's checkpoints: written to a staging directory, verified finite, published by
renames (`restarts/publishing.py`), uploaded and rotated only once published; `save_model` refuses non-finite weights.
With `save_in_background=True` the files are written and published by a writer thread after a host copy
(`restarts/background_save.py`; its readers: `background_checkpoints.py`). The contracts each keeps are listed in
`hooks.py`."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

from ..errors import NonFiniteWeightsError
from ..guard import refuse_save
from ..restarts.background_save import PendingSave
from ..restarts.output_lock import publishes_here
from ..restarts.publishing import publish
from ..restarts.rotation import rotate_up_to
from ..runtime.checkpoint_dirs import STAGING_DIR, checked_staging, checkpoint_dir, staging_run_dir
from ..runtime.finite import all_finite
from ..runtime.host_staging import stage_to_host
from ..runtime.saved_weights import written_part
from .background_checkpoints import announce, saves_in_background, training_stops_here
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
        """Write the checkpoint to a staging directory, then rename it: never half-written, never non-finite. With
        `save_in_background=True` only the host copy is made here; the writer thread writes, checks and publishes
        (`background_checkpoints.py`), and the readers are told once it is published; except at a step the loop ends
        after, whose save is written here (nothing would train while it is written)."""
        run = self.safe_run
        guard = run.guard
        if guard is None:
            return super()._save_checkpoint(model, trial)
        announce(self)  # at most one save in flight: the previous one is published, and announced, first
        step = self.state.global_step
        run.hooks_ran.ran("_save_checkpoint", step)
        if not guard.state_verified():
            refuse_save(run.events, step)  # not reached from the training loop, which restores a damaged state first
            run.hooks_ran.refused_save = step
            return
        if run.preemption is not None:  # a save decided after the step's end (epoch, best metric) is timed from here
            run.preemption.save_began(step)
        run_dir = self._get_output_dir(trial)
        staged, final = checkpoint_dir(staging_run_dir(run_dir), step), checkpoint_dir(run_dir, step)
        checked_staging(run_dir, create=True)  # a real directory of this user's, never a link
        publishes = publishes_here(self.args, run.output_lock)
        uploads = self.args.push_to_hub and not run.hooks.starting_checkpoint  # the starting state stays local
        # On every rank alike; only a publishing rank defers its writes. A save the loop ends after (the last step, a
        # preemption's stopping step) is written in line: `train()` would wait for it at once, after a needless copy.
        background = saves_in_background(self) and not training_stops_here(self)
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # no rotation inside staging: ours below
        run.hooks.staging, run.hooks.deferred = True, [] if background and publishes else None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            deferred, run.hooks.staging, run.hooks.deferred = run.hooks.deferred, False, None
            self.args.save_total_limit = limit
        verify_hooks(self, "save")  # the Trainer wrote to the staging directory, or the run stops here
        self.state.best_model_checkpoint = _published_best(self.state, run_dir, step)
        # Every rank's files are staged (its RNG state; a node sharing rank 0's storage wrote them all, with the
        # Trainer's own state and arguments) before the rank that publishes writes over them.
        self.accelerator.wait_for_everyone()
        if publishes:  # one process per storage: never a node sharing rank 0's (`save_on_each_node`)
            self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))  # with the published best path
            if os.path.isfile(os.path.join(staged, TRAINING_ARGS_NAME)):  # saved with `save_total_limit=None`
                torch.save(self.args, os.path.join(staged, TRAINING_ARGS_NAME))
            guard.state.save(staged, guard.spikes)  # with the spike window
        if background:  # the weights (most often), the optimizer and `training_args.bin`: the deferred writes
            pending = PendingSave(step, staged, final, run_dir, copy.deepcopy(self.state), publishes, uploads)
            writes = [write for _, write in deferred or ()]
            run.saves.start(pending, writes, lambda: [ready() for ready, _ in deferred or ()])
            return
        if publishes:
            publish(staged, final)
        self._after_published(final, run_dir, step, publishes, uploads)

    def _after_published(
        self, final: str, run_dir: str, step: int, publishes: bool, uploads: bool, saved_state: Any = None
    ) -> None:
        """What reads a published checkpoint, in order: the guard, the step record and the deadline, the hub upload,
        the rotation. `saved_state`: the `TrainerState` as saved, for a checkpoint announced at a later step (the
        upload's commit message and `on_push_begin` read the state's step)."""
        run = self.safe_run
        run.guard.published(final)
        self.accelerator.wait_for_everyone()
        run.progress.published(run_dir, step)  # before the upload and the rotation: a kill there keeps it resumable
        if run.preemption is not None:
            run.preemption.saved(step)  # timed until published (a background save's writer already told it)
        if uploads:
            live, self.state = self.state, saved_state if saved_state is not None else self.state
            try:
                self._push_from_checkpoint(final)
            finally:
                self.state = live
        if publishes:
            rotate_up_to(run_dir, step, self.args.save_total_limit, self.state.best_model_checkpoint)
        run.progress.published(run_dir, step)  # again, without the checkpoints the rotation removed

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        deferred = self.safe_run.hooks.deferred if self.safe_run.guard is not None else None
        if deferred is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # A background save on the rank that publishes (no DeepSpeed or FSDP): the optimizer's file written later.
        staged = stage_to_host(self.optimizer.state_dict(), self.safe_run.saves.buffers.optimizer)
        path = os.path.join(output_dir, OPTIMIZER_NAME)
        deferred.append((staged.ready, lambda: torch.save(staged.value, path)))
        with warnings.catch_warnings(record=True) as caught:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        reissue_pt_warnings(caught)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.safe_run.guard is not None and self.args.should_save:
            tensors = state_dict if state_dict is not None else self.model.state_dict()
            if not bool(all_finite(tensors.values())):
                bad = [k for k, t in tensors.items() if not bool(all_finite([t]))]
                raise NonFiniteWeightsError(output_dir or self.args.output_dir, bad[:10])
            deferred = self.safe_run.hooks.deferred
            part = written_part(self.model, tensors) if deferred is not None else None
            if part is not None:  # a background save: the host copy now, `save_pretrained` of it later
                os.makedirs(output_dir, exist_ok=True)  # the Trainer's small files are written there now
                staged = stage_to_host(part, self.safe_run.saves.buffers.model)
                save = super()._save
                deferred.append((staged.ready, lambda: save(output_dir, state_dict=staged.value)))
                return
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
