"""Where the NaN guard meets the Trainer's own bookkeeping: run start and resume, per-step losses, logs, checkpoints.

Every method here overrides a `transformers.Trainer` method, calls it, and adds the guard's part. Who reads what the
guard touches, and how each keeps its contract:

* `global_step`, the data position, the LR schedule: never rewound (a rollback restores weights and optimizer
  state only), so resume skips exactly the batches consumed and a run ends at `state.max_steps`.
* logs (`loss`, `train_loss`, W&B, TensorBoard): a window with a skipped step reports the mean over its applied
  steps ([`LossLedger`]); step numbers only grow, so plots read as a normal run plus `nan_guard/*` counters.
* checkpoints and `trainer_state.json`: written to a staging directory (a real directory of this user's, never a
  link), verified finite, then published by renames that leave a complete copy at every point of a crash, fsynced
  (`publishing.py`); the best-model path always names a published checkpoint; `on_save` and hub uploads only ever
  see published checkpoints.
* `save_model` / `push_to_hub`: refuse non-finite weights ([`NonFiniteWeightsError`]).
* resume: the guard's counters and LR backoff come back from `nan_guard_state.json`; `resume_from_checkpoint=True`
  and a restart by the elastic agent take the newest complete and finite checkpoint (`restarts/resume_plan.py`).
* crashes: the step record is kept on disk and a poisoned step's batches are not trained
  (`restarts/record_callback.py`); a run resumed at its last step (a restart after `train()` returned) trains no step
  past `max_steps`.
* `output_dir`: held by one run for the whole `train()` call; a second run is refused, and a node sharing rank 0's
  storage (`save_on_each_node=True`) publishes and rotates nothing (`restarts/output_lock.py`).
* rotation (`save_total_limit`): never deletes this run's newest checkpoint for higher-numbered ones
  (`restarts/rotation.py`), and runs only in `output_dir` after a publication: the Trainer's own rotation would run
  inside the staging directory, so `save_total_limit` is unset while the Trainer writes there.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import TrainOutput

from ..errors import NonFiniteWeightsError
from ..restarts.output_lock import OutputDirLock, hold_output_dir, publishes_here
from ..restarts.record_callback import StepProgressCallback
from ..restarts.resume_plan import record_resume, resolve_run
from ..restarts.rotation import rotate_up_to
from ..restarts.run_control import after_boundary, after_train, preempted_at_end
from .checkpoint_dirs import STAGING_DIR, checked_staging, checkpoint_dir, checkpoint_step, staging_run_dir
from .finite import all_finite
from .guard import NanGuard
from .hooks_ran import HooksRan, verify_hooks
from .publishing import publish, recover_staging
from .recovery import refuse_save

logger = logging.getLogger("safe_trainers")


@dataclass
class ClosedWindow:
    """A log window the ledger closed where the Trainer decided to log (`loss`: the mean over its applied steps, or
    `None` when the Trainer's own value stands), waiting for the Trainer's `log` call of that window."""

    loss: float | None


@dataclass
class HookState:
    """What the hooks below carry from one Trainer call to the next (one per trainer, made with its guard).

    Args:
        staging (`bool`): `_save_checkpoint` is writing a checkpoint: the Trainer's `_get_output_dir` answers the
            staging directory, and `_push_from_checkpoint` waits for the published one.
        starting_checkpoint (`bool`): the checkpoint being written is the run's starting state (never uploaded).
        window ([`ClosedWindow`] or `None`): closed by `_maybe_log_save_evaluate`, taken by `log`.
        last_finite_total_loss (`float`): the Trainer's last finite running loss total, put back over a NaN one.
    """

    staging: bool = False
    starting_checkpoint: bool = False
    window: ClosedWindow | None = None
    last_finite_total_loss: float = 0.0


class NanGuardTrainerMixin:
    """Mixed in before a `transformers.Trainer` subclass; active when `self.nan_guard` is a [`NanGuard`] (and then
    `self.guard_hooks` is its [`HookState`])."""

    nan_guard: NanGuard | None = None
    step_progress: StepProgressCallback | None = None
    preemption: Any = None  # `PreemptionCallback` and `HangWatchdog`, see `restarts/run_control.py`
    hang_watchdog: Any = None
    hooks_ran: HooksRan | None = None  # marked by the hooks below when they run (`hooks_ran.py`)
    guard_hooks: HookState | None = None
    output_lock: OutputDirLock | None = None  # this process's hold on `output_dir` during `train()`

    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval=None, **kwargs
    ):
        """The Trainer's `train()`, holding `output_dir` for the whole call: a second run there is refused with
        [`OutputDirInUseError`] (`restarts/output_lock.py`), with or without the guard."""
        with hold_output_dir(self) as self.output_lock:
            return self._train_in_output_dir(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _train_in_output_dir(
        self, resume_from_checkpoint: str | bool | None, trial: Any, ignore_keys_for_eval, **kwargs
    ):
        guard = self.nan_guard
        if guard is not None:  # a save a crash interrupted is finished or undone (`publishing.py`)
            for line in recover_staging(self.args.output_dir, main=self.is_world_process_zero()):
                logger.warning(f"NaN guard: {line}")
        plan = resolve_run(self, resume_from_checkpoint)  # `True` and restarts: the newest healthy checkpoint
        if guard is not None:
            self.hooks_ran.clear()  # each `train()` call proves its own hooks (`hooks_ran.py`)
            guard.start_run(plan.checkpoint)
            record_resume(guard, plan)
            if self.step_progress is not None:
                self.step_progress.start(plan.history, plan.data, checkpoint_step(plan.checkpoint or "") or 0)
        try:
            output = super().train(
                resume_from_checkpoint=plan.checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        finally:
            after_train(self)  # signal handlers back, watchdog stopped
        if guard is not None:
            guard.finish()
        if guard is not None and "train_loss" in output.metrics:
            output = output._replace(training_loss=output.metrics["train_loss"])  # as logged (see `log`)
        result = plan.history.result if plan.finished else None
        if result is not None and result["global_step"] == output.global_step:
            output = TrainOutput(**result)  # what this call returned before the restart
        preempted = preempted_at_end(self) if guard is not None else None  # the final state published first
        if self.step_progress is not None:
            self.step_progress.finished(output)
        if preempted is not None:
            raise preempted  # a signal during or after the last step: the run finished (and is recorded so), exits
        return output

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """No step past `max_steps`: a run resumed from a checkpoint of its last step (a restart after `train()`
        finished, or `resume_from_checkpoint` given the final checkpoint) stops before fetching a batch, where the
        Trainer would train one more step before checking."""
        if self.state.global_step >= self.state.max_steps > 0:
            self.control.should_training_stop = True
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        guard = self.nan_guard
        if guard is not None and model.training and not guard.replaying:
            guard.record_inputs(inputs)
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.nan_guard is not None:
            self.hooks_ran.ran("training_step")
        if self.step_progress is not None and self.step_progress.dropping:  # a poisoned step: not trained
            return self.step_progress.dropped_loss(self.args.device)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.nan_guard is not None:
            self.nan_guard.observe_loss(loss)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self.nan_guard is not None:
            self.hooks_ran.ran("_get_grad_norm")
            dropped = self.step_progress is not None and self.step_progress.dropping
            self.nan_guard.end_of_step(grad_norm, dropped=dropped)
        return grad_norm

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.nan_guard is not None and checkpoint is not None:
            self.hooks_ran.ran("_load_optimizer_and_scheduler")
            self.nan_guard.resumed_learning_rate(self.optimizer, self.lr_scheduler)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        guard = self.nan_guard
        if guard is not None:
            self.hooks_ran.ran("_maybe_log_save_evaluate")
            guard.before_publishing(self.control)
            if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
                # The Trainer logs its loss window now, on every rank (as the ledger's collective needs); a
                # `log({"loss": ...})` from anywhere else leaves the window alone.
                self.guard_hooks.window = ClosedWindow(guard.ledger.close_window())
        super()._maybe_log_save_evaluate(*args, **kwargs)
        after_boundary(self)  # the step every rank stops at for a preemption has saved: exit

    # ------------------------------------------------------------------ logs
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        guard = self.nan_guard
        if guard is not None:
            hooks = self.guard_hooks
            if "loss" in logs and hooks.window is not None:  # the Trainer's own window log
                window, hooks.window = hooks.window, None
                if window.loss is not None:
                    logs["loss"] = window.loss
                # The Trainer's running totals must not stay NaN forever after a skipped step.
                if isinstance(self._tr_loss, torch.Tensor) and not bool(torch.isfinite(self._tr_loss)):
                    self._tr_loss.zero_()
                if math.isfinite(self._total_loss_scalar):
                    hooks.last_finite_total_loss = self._total_loss_scalar
                else:
                    self._total_loss_scalar = hooks.last_finite_total_loss
            if "train_loss" in logs:
                value = guard.ledger.train_loss()
                if value is not None:
                    logs["train_loss"] = value
            if "train_runtime" not in logs:
                logs.update(guard.state.counters())
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        if self.nan_guard is None or not self.guard_hooks.staging:
            return run_dir
        self.hooks_ran.ran("_get_output_dir", self.state.global_step)  # the Trainer's save asked where to write
        return staging_run_dir(run_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self.nan_guard is None or not self.guard_hooks.staging:  # uploaded once published (see `_save_checkpoint`)
            super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint to a staging directory, then rename it: never half-written, never non-finite."""
        guard = self.nan_guard
        if guard is None:
            return super()._save_checkpoint(model, trial)
        step = self.state.global_step
        self.hooks_ran.ran("_save_checkpoint", step)
        if not guard.state_verified():
            refuse_save(guard.events, step)  # not reached from the training loop, which restores a damaged state first
            self.hooks_ran.refused_save = step
            return
        run_dir = self._get_output_dir(trial)
        staged, final = checkpoint_dir(staging_run_dir(run_dir), step), checkpoint_dir(run_dir, step)
        checked_staging(run_dir, create=True)  # a real directory of this user's, never a link
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # no rotation inside staging: ours below
        self.guard_hooks.staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.guard_hooks.staging = False
            self.args.save_total_limit = limit
        verify_hooks(self, "save")  # the Trainer wrote to the staging directory, or the run stops here
        self.state.best_model_checkpoint = _published_best(self.state, run_dir, step)
        self.accelerator.wait_for_everyone()
        if publishes_here(self):  # one process per storage: never a node sharing rank 0's (`save_on_each_node`)
            self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))  # with the published best path
            if os.path.isfile(os.path.join(staged, TRAINING_ARGS_NAME)):  # saved with `save_total_limit=None`
                torch.save(self.args, os.path.join(staged, TRAINING_ARGS_NAME))
            guard.state.save(staged, guard.spikes)  # with the spike window
            publish(staged, final)
        if guard.snapshotter is not None:
            guard.snapshotter.published(final)
        self.accelerator.wait_for_everyone()
        if self.step_progress is not None:  # before the upload and the rotation: a kill there keeps it resumable
            self.step_progress.published(run_dir, step)
        if self.args.push_to_hub and not self.guard_hooks.starting_checkpoint:
            self._push_from_checkpoint(final)
        if publishes_here(self):
            rotate_up_to(run_dir, step, self.args.save_total_limit, self.state.best_model_checkpoint)
        if self.step_progress is not None:  # again, without the checkpoints the rotation removed
            self.step_progress.published(run_dir, step)

    def save_starting_checkpoint(self) -> None:
        """Publish the state training starts from as a checkpoint, for `nan_rollback_from="checkpoint"` (verified
        and staged like any checkpoint; not uploaded to the Hub)."""
        self.guard_hooks.starting_checkpoint = True
        try:
            self._save_checkpoint(self.model_wrapped, trial=None)
        finally:
            self.guard_hooks.starting_checkpoint = False

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.nan_guard is not None and self.args.should_save:
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
