"""Where the NaN guard meets the Trainer's own bookkeeping: run start and resume, per-step losses and logs (this
module), checkpoints (`checkpoints.py`).

Every method here overrides a `transformers.Trainer` method, calls it, and adds the guard's part; the run they act
for is `self.safe_run` ([`SafeRun`], `run.py`). Who reads what the
guard touches, and how each keeps its contract:

* `global_step`, the data position, the LR schedule: never rewound (a rollback restores weights and optimizer
  state only), so resume skips exactly the batches consumed and a run ends at `state.max_steps`.
* logs (`loss`, `train_loss`, W&B, TensorBoard): a window with a skipped step reports the mean over its applied
  steps ([`LossLedger`]); step numbers only grow, so plots read as a normal run plus `nan_guard/*` counters.
* checkpoints and `trainer_state.json`: written to a staging directory (a real directory of this user's, never a
  link), verified finite, then published by renames that leave a complete copy at every point of a crash, fsynced
  (`publishing.py`); the best-model path always names a published checkpoint; `on_save` and hub uploads only ever
  see published checkpoints; a checkpoint written in the background (`save_in_background`) is announced to them on
  the training thread once published (`background_checkpoints.py`), and before the best model is loaded, a
  preemption exits and `train()` returns.
* `save_model` / `push_to_hub`: refuse non-finite weights ([`NonFiniteWeightsError`]).
* resume: the guard's counters and LR backoff come back from `nan_guard_state.json`; `resume_from_checkpoint=True`
  and a restart by the elastic agent take the newest complete and finite checkpoint (`restarts/resume_plan.py`).
* crashes: the step record is kept on disk and a poisoned step's batches are not trained
  (`restarts/step_progress.py`); a run resumed at its last step (a restart after `train()` returned) trains no step
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
from typing import Any

import torch
from transformers.trainer_utils import TrainOutput

from ..restarts.output_lock import hold_output_dir
from ..restarts.publishing import recover_staging
from ..restarts.resume_plan import record_resume, resolve_run
from ..runtime.checkpoint_dirs import resumed_step
from . import inspection
from .background_checkpoints import (
    announce, announce_if_written, announce_on_error, prepare_buffers, training_stops_here,
)  # fmt: skip
from .checkpoints import CheckpointHooks
from .run import ClosedWindow, SafeRun
from .run_control import after_boundary, after_train, preempted_at_end

logger = logging.getLogger("safe_trainers")


class NanGuardTrainerMixin(CheckpointHooks):
    """Mixed in before a `transformers.Trainer` subclass; the guard's part is active when `self.safe_run.guard` is a
    [`NanGuard`] (also `self.nan_guard`)."""

    nan_guard: Any = None
    safe_run: SafeRun  # set per trainer before TRL's constructor runs (`mixin.py`)

    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval=None, **kwargs
    ):
        """The Trainer's `train()`, holding `output_dir` for the whole call: a second run there is refused with
        [`OutputDirInUseError`] (`restarts/output_lock.py`), with or without the guard."""
        with hold_output_dir(self.args) as self.safe_run.output_lock:
            return self._train_in_output_dir(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _train_in_output_dir(
        self, resume_from_checkpoint: str | bool | None, trial: Any, ignore_keys_for_eval, **kwargs
    ):
        run = self.safe_run
        guard = run.guard
        if guard is not None:  # a save a crash interrupted is finished or undone (`publishing.py`)
            for line in recover_staging(self.args.output_dir, main=self.is_world_process_zero()):
                logger.warning(f"NaN guard: {line}")
        dataset = getattr(self, "train_dataset", None)
        rows = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
        settings = getattr(self, "safety_settings", None)
        plan = resolve_run(self.args, settings, rows, resume_from_checkpoint)  # `True`, restarts: the newest healthy
        if guard is not None:
            run.hooks_ran.clear()  # each `train()` call proves its own hooks (`hooks_ran.py`)
            guard.start_run(plan.checkpoint, self.optimizer)
            record_resume(run.events, plan)
            run.progress.start(plan.history, plan.data, resumed_step(plan.checkpoint))
        try:
            output = super().train(
                resume_from_checkpoint=plan.checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
            if guard is not None:
                announce(self)  # the last save is published before `train()` returns
        finally:
            if run.saves is not None and guard is not None:
                announce_on_error(self)  # left by an exception: a save in flight is published and announced
            if run.saves is not None:
                run.saves.close()  # the writer is done before `output_dir` is let go
            if guard is not None:
                inspection.before_write(self)  # the caller may write the weights next: no snapshot copy in flight
                after_train(self)  # signal handlers back, watchdog stopped
        if guard is not None:
            inspection.finish(self)
        if guard is not None and "train_loss" in output.metrics:
            output = output._replace(training_loss=output.metrics["train_loss"])  # as logged (see `log`)
        result = plan.history.result if plan.finished else None
        if result is not None and result["global_step"] == output.global_step:
            output = TrainOutput(**result)  # what this call returned before the restart
        preempted = preempted_at_end(self) if guard is not None else None  # the final state published first
        if run.saves is not None:
            run.saves.buffers.release()  # the host copy of the state is not held past `train()`
        if run.progress is not None:
            run.progress.finished(output)
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
        run = self.safe_run
        if run.guard is not None and model.training and not run.hooks.replaying:
            run.guard.record_inputs(inputs)
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        run = self.safe_run
        if run.guard is not None:
            run.hooks_ran.ran("training_step")
        if run.progress is not None and run.progress.dropping:  # a poisoned step: not trained
            if run.guard is not None and run.guard.bundles_on:  # kept for its replay bundle, never replayed here
                run.guard.record_inputs(inputs, dropped=True)
            return run.progress.dropped_loss(self.args.device)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if run.guard is not None:
            run.guard.observe_loss(loss)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        run = self.safe_run
        if run.guard is not None:
            run.hooks_ran.ran("_get_grad_norm")
            # DeepSpeed has already stepped (inside `backward`); it skips steps with non-finite gradients itself.
            skipped = run.guard.deepspeed and bool(self.accelerator.optimizer_step_was_skipped)
            run.guard.end_of_step(grad_norm, backend_skipped=skipped, dropped=run.progress.dropping)
        return grad_norm

    def _load_best_model(self) -> None:
        if self.safe_run.guard is not None:  # it writes the weights: the last snapshot's copies finish first
            announce(self)  # and the best checkpoint is published (it may be the one in flight)
            inspection.before_write(self)
        super()._load_best_model()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        run = self.safe_run
        if run.guard is not None and checkpoint is not None:
            run.hooks_ran.ran("_load_optimizer_and_scheduler")
            run.guard.resumed_learning_rate(self.optimizer, self.lr_scheduler)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        run = self.safe_run
        if run.guard is not None:
            run.hooks_ran.ran("_maybe_log_save_evaluate")
            announce_if_written(self)  # a background save's readers, once it is published
            prepare_buffers(self)  # once, after the first step: the first save's host buffers, off this thread
            if self.control.should_save or self.control.should_evaluate:
                # Right before the Trainer evaluates or saves: verify the state afresh (a callback that runs after
                # the guard's may have asked for the save or evaluation, or changed the weights since the guard's
                # check; unless no callback can: `read_only.py`), and keep it as a snapshot if the guard's own
                # inspection did not (a save or evaluation asked for after it). A collective every rank must reach:
                # timed by the watchdog like a step.
                with run.guard.clock.armed():
                    fresh, snapshot = not run.callbacks_read_only, inspection.unsnapshotted(self)
                    inspection.inspect(self, verify=True, fresh=fresh, snapshot=snapshot)
            if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
                # The Trainer logs its loss window now, on every rank (as the ledger's collective needs); a
                # `log({"loss": ...})` from anywhere else leaves the window alone.
                run.hooks.window = ClosedWindow(run.guard.ledger.close_window())
        super()._maybe_log_save_evaluate(*args, **kwargs)
        if run.guard is not None and training_stops_here(self):
            announce(self)  # nothing after the loop (best model, exit, return) reads a checkpoint in flight
        if run.guard is not None:
            after_boundary(self)  # the step every rank stops at for a preemption has saved: exit

    # ------------------------------------------------------------------ logs
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        run = self.safe_run
        if run.guard is not None:
            hooks = run.hooks
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
                value = run.guard.ledger.train_loss()
                if value is not None:
                    logs["train_loss"] = value
            if "train_runtime" not in logs:
                logs.update(run.guard.state.counters())
        super().log(logs, *args, **kwargs)
