"""`NanGuard`: keeps non-finite updates out of the weights and rolls back to the last good state.

Per optimizer step, with no host-device synchronisation, [`StepFlags`] keeps a device fault flag (losses and gradient
norm, agreed across ranks), and `apply_skip` hands it to the optimizer before `optimizer.step()` (`skip.py`): fused
torch optimizers, or an fp16 `GradScaler`, take it as `found_inf` and skip the update on the device; other optimizers
fall back to one host read and drop the gradients; DeepSpeed skips non-finite steps itself. An fp16 loss scaler's
overflow is recorded, not a fault. A loss or gradient-norm spike (`spikes.py`) joins the same flag and is skipped
the same way, before its update.

At inspection points (log, save, evaluation, the last step, every `nan_snapshot_steps`) the flags are read back in
one transfer and judged by the pure policy (`policy.judge_window`). The timeline never rewinds: a rollback puts back
only the weights and optimizer state of the last snapshot (see `recovery.py`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from ..restarts.watchdog import UNWATCHED
from .backends import Backend, refuse_unsupported_backend, training_backend, unwrap_optimizer
from .checkpoint_dirs import checkpoint_step
from .finite import all_finite, deepspeed_state_tensors, optimizer_tensors
from .collectives import ranks_with_flag
from .disk_snapshot import CheckpointSnapshotter
from .events import EventLog
from .good_state import RollbackSource, rollback_source
from .ledger import LossLedger
from .localize import RecentBatches, diagnose
from .policy import StepRecord, Verdict, can_roll_back, diagnosed_step, judge_window, spike_run_rolled_back
from .policy import syncs_reference_model, unexplained_overflows
from .recovery import (
    Restored, abort, nonfinite_start_message, record_rollback, record_window, restore_at_end, restore_last_good,
    scale_learning_rate, undo_backoff,
)  # fmt: skip
from .snapshot import Snapshotter
from .spikes import SpikeSettings, SpikeWindow
from .state import GuardState
from .step_flags import StepFlags, loss_scale

logger = logging.getLogger("safe_trainers")


class NanGuard:
    """The NaN guard of one trainer.

    Args:
        trainer (`transformers.Trainer`): the trainer it protects (a `safe_trainers` trainer).
        settings ([`SafetyArguments`]): the `nan_*` settings.
    """

    def __init__(self, trainer: Any, settings: Any):
        refuse_unsupported_backend(trainer)
        self.trainer = trainer
        self.settings = settings
        self.events = EventLog(trainer.args.output_dir, write=trainer.is_world_process_zero())
        self.ledger = LossLedger()
        self.batches = RecentBatches()
        self.state = GuardState()
        self.rollbacks_this_run = 0
        self.spikes: SpikeWindow | None = None
        self.replaying = False
        self.backend: Backend | None = None  # with `rollback_from`, decided when training starts (`begin`)
        self.rollback_from: str = settings.nan_rollback_from
        self.snapshotter: RollbackSource | None = None
        self.resumed_from: str | None = None
        self.verified_step = -1
        self.damaged_ranks: list[int] = []
        self.flags, self.deepspeed = StepFlags(), False  # DeepSpeed steps in `backward`, skips non-finite steps itself
        self.preemption, self.watchdog = None, UNWATCHED  # or a `PreemptionCallback`, a `HangWatchdog` (run_control)
        self._consecutive = 0
        self._refresh_best = False

    # ------------------------------------------------------------------ lifecycle
    def start_run(self, resume_from: str | None) -> None:
        """Called by `train()`: a new run starts its own event log and counters; a resumed run restores them."""
        if resume_from is None:  # a new run on the same trainer reuses its optimizer: the previous backoff goes
            undo_backoff(unwrap_optimizer(self.trainer.optimizer), self.state.lr_scale)
        resumed_at = None
        if resume_from is not None:  # a directory not named `checkpoint-N` keeps the whole log
            step = checkpoint_step(resume_from)
            resumed_at = step if step is not None else sys.maxsize
        moved = self.events.start_run(resumed_at=resumed_at)
        if moved:
            logger.info(f"NaN guard: the previous run's event log was kept as {moved}.")
        self.resumed_from = resume_from
        saved = GuardState.load(resume_from) if resume_from is not None else None
        self.state = saved or GuardState(learning_rate=self.trainer.args.learning_rate)
        self.rollbacks_this_run = 0
        spikes = SpikeSettings.from_settings(self.settings)
        self.spikes = SpikeWindow(spikes, self.state.spike_window) if spikes.enabled else None
        self.ledger.begin_run()

    def begin(self) -> None:
        """Called at `on_train_begin`: bind to the optimizer and take the first snapshot."""
        trainer, backend = self.trainer, training_backend(self.trainer)
        self.backend, self.deepspeed = backend, backend.zero_stage is not None
        self.rollback_from, note = rollback_source(self.settings, trainer.args, trainer.safety_report)
        if note is not None and trainer.is_world_process_zero():
            logger.warning(note)  # the config and the guard disagree: said, with the rule that decided
        if self.rollback_from == "checkpoint":
            save = trainer.save_starting_checkpoint
            self.snapshotter = CheckpointSnapshotter(trainer, backend, self.events, save, self.resumed_from)
        else:
            self.snapshotter = Snapshotter(trainer.model, backend, resumed_from=self.resumed_from)
        self.flags = StepFlags(backend.loss_scaled, self.spikes)
        self.batches.clear()
        if not self.state_is_finite():
            raise ValueError(nonfinite_start_message(self.damaged_ranks))
        self.take_snapshot()

    def resumed_learning_rate(self, optimizer: Any, scheduler: Any) -> None:
        """After a checkpoint's optimizer and scheduler were loaded: they carry the backed-off LR; if the user now
        asks for a different `learning_rate`, scale to it (the backoff still applies)."""
        configured, saved = self.trainer.args.learning_rate, self.state.learning_rate
        if saved and configured and configured != saved:
            scale_learning_rate(optimizer, scheduler, configured / saved)
        self.state.learning_rate = configured

    # ------------------------------------------------------------------ hot path (no host sync)
    def record_inputs(self, inputs: Any) -> None:
        """Keep a host copy of one micro-batch's prepared inputs, for diagnosis."""
        self.batches.record(inputs)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Fold one micro-batch loss (as `training_step` returns it) into the step's flag and sums."""
        self.flags.observe_loss(loss)
        self.ledger.add_micro_batch(loss)

    def end_of_step(self, grad_norm: Any, dropped: bool = False) -> torch.Tensor:
        """Combine the step's loss flag with the gradient norm, agree across ranks; return the device fault flag.
        `dropped`: the step's batches were not trained (a poisoned step, see `restarts/record_callback.py`): a
        skipped step."""
        # DeepSpeed has already stepped (inside `backward`); it skips steps with non-finite gradients itself.
        skipped = self.deepspeed and bool(self.trainer.accelerator.optimizer_step_was_skipped)
        step = self.trainer.state.global_step + 1
        fault = self.flags.end_step(step, grad_norm, self.trainer.args.device, skipped, dropped, self.preemption)
        self.batches.end_step(step)
        self.ledger.end_step(fault)
        return fault

    def apply_skip(self, optimizer: Any) -> None:
        """Make `optimizer.step()` a no-op when the step is a fault (called after clipping, before the step)."""
        if not self.deepspeed:  # DeepSpeed skips them itself
            self.flags.skip_update(optimizer, self.trainer.accelerator.scaler)

    # ------------------------------------------------------------------ inspection
    def at_boundary(self, control: Any) -> Verdict | None:
        """Called where the Trainer is about to log, evaluate or save (every step, before it does): inspect when due.

        The state is verified before every save, evaluation and the end of training, so none of them ever sees
        non-finite weights: a damaged state is rolled back first.
        """
        trainer = self.trainer
        step = trainer.state.global_step
        self.verified_step = -1  # callbacks after the guard's may have changed the state since it was last verified
        self._refresh_best_fields()
        snapshot_due = step % self.settings.nan_snapshot_steps == 0
        publishing = bool(control.should_save or control.should_evaluate or control.should_training_stop)
        publishing = publishing or syncs_reference_model(trainer.args, step)
        backlog = len(self.flags.pending) >= self.settings.nan_snapshot_steps
        if control.should_log or publishing or snapshot_due or backlog:
            return self.inspect(control, verify=publishing or snapshot_due, snapshot=publishing or snapshot_due)
        return None

    def before_publishing(self, control: Any) -> None:
        """Right before the Trainer evaluates or saves: verify the state afresh (a callback that runs after the
        guard's may have asked for the save or evaluation, or changed the weights since the guard's check)."""
        if control.should_save or control.should_evaluate:
            self.verified_step = -1
            with self.watchdog.armed():  # a collective every rank must reach: timed by the watchdog like a step
                self.inspect(control, verify=True)

    def finish(self) -> None:
        """When `train()` returns, after every callback of the last step and of `on_train_end`: verify once more
        (every rank) and put the last good state back if something damaged it after the last check."""
        if self.snapshotter is None:
            return
        self.verified_step = -1
        if not self.state_is_finite():
            restored = restore_at_end(self.trainer, self.snapshotter, self.events, self.damaged_ranks)
            self.verified_step = restored.at_step

    def before_generation(self) -> None:
        """GRPO/RLOO, before sampling a generation batch: judge the pending steps and verify the state now (not from
        the cache: generation is far costlier than the check), rolling back a damaged state before it samples."""
        self.verified_step = -1
        self.inspect(self.trainer.control, verify=True)

    def inspect(self, control: Any, verify: bool = False, snapshot: bool = False) -> Verdict | None:
        """Read the pending flags, record skips, roll back or abort if needed, take a snapshot when asked."""
        if not self.flags.pending and not verify:
            return None
        records = self.flags.read()
        if any(r.overflow for r in records):
            records = unexplained_overflows(records, loss_scale(self.trainer, self.deepspeed))
        any_bad = any(r.bad for r in records)
        state_finite = self.state_verified() if (any_bad or verify) else True
        limit = self.settings.nan_max_consecutive_skips
        verdict = judge_window(records, self._consecutive, limit, self.deepspeed, state_finite)
        self._consecutive = verdict.consecutive
        diagnosed = diagnosed_step(verdict) if not self.state.localized else None
        diagnosis = self._localize(diagnosed) if diagnosed is not None else None
        record_window(self.events, verdict, diagnosis, self.state, spikes_skipped=not self.deepspeed)
        self.ledger.record_skips(len(verdict.skipped) + len(verdict.spikes))
        self.batches.clear()
        if verdict.rollback is not None:
            if can_roll_back(self.rollbacks_this_run, self.settings.nan_max_rollbacks):
                self.rollback(verdict, records, diagnosis if not verdict.skipped else None)
            else:
                self.abort(verdict)
        elif snapshot and state_finite and verdict.consecutive == 0:
            # Only right after an applied step: a rollback then restores the state before the fault.
            self.take_snapshot()
        return verdict

    def state_is_finite(self) -> bool:
        """Whether the weights and optimizer state are finite on every rank (a collective and a host sync).

        The ranks whose own state is non-finite are kept in `self.damaged_ranks`.
        """
        backend = self.backend
        if backend is not None and backend.zero_stage is not None:
            tensors = deepspeed_state_tensors(backend.optimizer, backend.zero_stage)
        else:
            opt = backend.optimizer if backend is not None else unwrap_optimizer(self.trainer.optimizer)
            tensors = list(self.trainer.model.parameters()) + (optimizer_tensors(opt) if opt is not None else [])
        finite = all_finite(tensors).to(self.trainer.args.device)
        self.damaged_ranks = [rank for ranks in ranks_with_flag((~finite).reshape(1)) for rank in ranks]
        # A check that finds damage takes back an earlier verification of this step.
        self.verified_step = -1 if self.damaged_ranks else self.trainer.state.global_step
        return not self.damaged_ranks

    def state_verified(self) -> bool:
        """Whether the state is known finite at this step (checked now unless this step was already verified)."""
        return self.verified_step == self.trainer.state.global_step or self.state_is_finite()

    # ------------------------------------------------------------------ actions
    def take_snapshot(self) -> None:
        with self.watchdog.paused():  # a copy of the whole state: not timed as part of the step by the hang watchdog
            self.snapshotter.take(self.trainer.state)
        # Taken in `on_step_end`, before this step's evaluation and save, which belong to the same weights: the
        # best-model fields are refreshed at the next boundary (or rollback), once they have run.
        self._refresh_best = True

    def _refresh_best_fields(self) -> None:
        if self._refresh_best and self.snapshotter is not None:
            self.snapshotter.refresh_best_fields(self.trainer.state)
            self._refresh_best = False

    def rollback(self, verdict: Verdict, records: list[StepRecord], diagnosis: dict | None) -> None:
        """Restore the last good state and go on (see `recovery.py`); record a `rollback` event."""
        restored = self._restore_last_good(verdict)
        self.state.rollbacks += 1
        self.rollbacks_this_run += 1
        facts = (self.events, verdict, records, diagnosis, restored, self.state.rollbacks, self.damaged_ranks)
        record_rollback(*facts, max_steps=self.trainer.state.max_steps)

    def abort(self, verdict: Verdict) -> None:
        """Restore the last good state, save it as a checkpoint, record an `abort` event and raise."""
        restored = self._restore_last_good(verdict)  # verified and counted before the checkpoint saves it
        with self.watchdog.paused():  # the checkpoint's save is not timed with the step (a hang would restart it)
            abort(self.trainer, self.events, verdict, restored, self.state, self.rollbacks_this_run, self.settings)

    def _restore_last_good(self, verdict: Verdict) -> Restored:
        if self.spikes is not None and spike_run_rolled_back(verdict):
            self.spikes.restart()  # warm up again on the run's level (also in the abort's saved state)
        self._refresh_best_fields()  # the snapshot's weights go back with the best-model fields of their time
        with self.watchdog.paused():  # from memory, or a whole checkpoint from disk
            restored = restore_last_good(self.trainer, self.snapshotter, self.settings.nan_lr_backoff)
        self._after_restore(restored)
        return restored

    def _after_restore(self, restored: Restored) -> None:
        """Count the backoff and discarded steps, trust the restored state (verified when taken), drop the window."""
        self.state.lr_scale *= restored.lr_factor
        self.state.discarded_steps += len(restored.discarded_steps)
        self.verified_step = restored.at_step
        self._consecutive = 0
        self.flags.clear()
        self.batches.clear()

    def _localize(self, step: int | None) -> dict[str, Any] | None:
        batches = self.batches.get(step)
        if not batches:  # every rank holds the batches of the same steps, so all ranks return here together
            return None
        self.state.localized = self.replaying = True
        try:
            with self.watchdog.paused():  # a replay of the step's micro-batches: not timed with the step
                return diagnose(self.trainer, batches, step)
        finally:
            self.replaying = False


__all__ = ["NanGuard"]
