"""`NanGuard`: keeps non-finite updates out of the weights and rolls back to the last good state.

Per optimizer step, with no host-device synchronisation, [`StepFlags`] keeps a device fault flag (losses and gradient
norm, agreed across ranks; a loss or gradient-norm spike joins it), and `apply_skip` hands it to the optimizer before
`optimizer.step()` so the update is not applied (`step/`). An fp16 loss scaler's overflow is recorded, not a fault.

At inspection points (log, save, evaluation, the last step, each snapshot: `snapshot_interval.py`) the flags are read
back in one transfer and judged ([`judge`], `policy.py`); [`settle`] decides. A rollback puts back the weights and
optimizer state (`rollback/`). The guard holds no trainer: what only the trainer can do, it returns ([`Decision`]).
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import Any

import torch

from ..errors import TrainingDivergedError
from ..runtime.checkpoint_dirs import checkpoint_step
from ..runtime.collectives import ranks_with_flag
from ..runtime.events import EventLog
from ..runtime.finite import all_finite
from ..runtime.ports import UNWATCHED, FlagRider, StepClock
from .backends import Backend, state_bytes, state_tensors, unwrap_optimizer
from .bundles import bundles_for
from .diagnosis import RecentBatches
from .policy import (
    can_roll_back,
    diagnosed_step,
    inspection_due,
    judge_window,
    spike_run_rolled_back,
    unexplained_overflows,
)
from .port import Decision, EndRestore, GuardPort, Judged
from .records import diverged_error, nonfinite_start_message, record_rollback, record_window
from .rollback.actions import Restored, follow_learning_rate, record_end_restore, restore_last_good, undo_backoff
from .rollback.checkpoint import CheckpointSource
from .rollback.memory import HostSnapshot
from .rollback.source import RollbackSource
from .snapshot_interval import SnapshotInterval
from .state import GuardState
from .step.flags import StepFlags, loss_scale
from .step.ledger import LossLedger
from .step.spikes import SpikeSettings, SpikeWindow

logger = logging.getLogger("safe_trainers")


class NanGuard:
    """The NaN guard of one trainer.

    Args:
        settings ([`SafetyArguments`]): the `nan_*` settings.
        config: the trainer's config (`TrainingArguments`: `learning_rate`, the reference-model sync settings).
        port ([`GuardPort`]): what the guard reads from the loop while it trains.
        events ([`EventLog`]): the run's event log.
        clock ([`StepClock`], *optional*): what times the steps (the hang watchdog), paused around the guard's copies.
        riders (`tuple[FlagRider, ...]`): flags riding on the per-step all-reduce (the preemption request, the writers).
    """

    def __init__(
        self, settings: Any, config: Any, port: GuardPort, events: EventLog, clock: StepClock = UNWATCHED,
        riders: tuple[FlagRider, ...] = (),
    ):  # fmt: skip
        self.settings, self.config, self.port = settings, config, port
        self.events, self.clock, self.riders = events, clock, riders
        self.ledger, self.batches, self.state, self.rollbacks_this_run = LossLedger(), RecentBatches(), GuardState(), 0
        self.spikes: SpikeWindow | None = None
        self.backend: Backend | None = None  # bound when training starts (`begin`)
        self.rollback_from: str = settings.nan_rollback_from
        self.snapshotter: RollbackSource | None = None
        self.resumed_from: str | None = None
        self.verified_step, self.damaged_ranks = -1, []  # the step known finite; the ranks found damaged
        self.flags, self.deepspeed = StepFlags(), False  # DeepSpeed steps in `backward`, skips non-finite steps itself
        self.interval = SnapshotInterval(settings)  # how many steps apart the snapshots are (it adapts)
        self.bundles_on = getattr(settings, "nan_replay_max_bytes", 0) > 0  # faulted steps kept (docs/replay.md)
        self._consecutive = 0
        self._refresh_best = False

    def start_run(self, resume_from: str | None, optimizer: Any = None) -> None:
        """A `train()` call starts: a new run starts its own event log and counters (and takes a previous run's
        backoff off `optimizer`, the trainer's from that run, if any); a resumed run restores them."""
        if resume_from is None:  # a new run on the same trainer reuses its optimizer: the previous backoff goes
            undo_backoff(unwrap_optimizer(optimizer), self.state.lr_scale)
        step = checkpoint_step(resume_from) if resume_from is not None else None
        # A directory not named `checkpoint-N` keeps the whole log.
        resumed_at = None if resume_from is None else step if step is not None else sys.maxsize
        moved = self.events.start_run(resumed_at=resumed_at)
        if moved:
            logger.info(f"NaN guard: the previous run's event log was kept as {moved}.")
        self.resumed_from = resume_from
        saved = GuardState.load(resume_from) if resume_from is not None else None
        self.state = saved or GuardState(learning_rate=self.config.learning_rate)
        self.rollbacks_this_run = 0
        spikes = SpikeSettings.from_settings(self.settings)
        self.spikes = SpikeWindow(spikes, self.state.spike_window) if spikes.enabled else None
        self.ledger.begin_run()

    def begin(self, backend: Backend, rollback_from: str) -> bool:
        """Training starts: bind to `backend` (optimizer, ZeRO stage, loss scaler), keep the last good state in
        `rollback_from` (`"memory"`/`"checkpoint"`), take the first; returns whether the caller must publish it."""
        self.backend, self.deepspeed = backend, backend.zero_stage is not None
        self.rollback_from = rollback_from
        model = self.port.model
        if rollback_from == "checkpoint":
            self.snapshotter = CheckpointSource(model, backend, self.events, self.config.output_dir, self.resumed_from)
        else:
            self.snapshotter = HostSnapshot(model, backend, self.resumed_from, self.events, self.config.output_dir)
        self.flags = StepFlags(backend.loss_scaled, self.spikes)
        self.batches.clear()
        self.interval.start(self.config, self.port.state, self.events.write, partial(state_bytes, backend, model))
        with self.interval.timed():  # the first snapshot's check, part of its cost as every snapshot's is
            finite = self.state_is_finite()
        if not finite:
            raise ValueError(nonfinite_start_message(self.damaged_ranks))
        return self.take_snapshot()

    def resumed_learning_rate(self, optimizer: Any, scheduler: Any) -> None:
        """A checkpoint's optimizer and scheduler were loaded: follow a new `learning_rate` (`follow_learning_rate`)."""
        self.state.learning_rate = follow_learning_rate(optimizer, scheduler, self.config, self.state.learning_rate)

    # ------------------------------------------------------------------ hot path (no host sync)
    def record_inputs(self, inputs: Any, dropped: bool = False) -> None:
        """Keep a host copy of one micro-batch's inputs, for diagnosis (`dropped`: a poisoned step's, bundle only)."""
        self.batches.record(inputs, dropped)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Fold one micro-batch loss (as `training_step` returns it) into the step's flag and sums."""
        self.flags.observe_loss(loss)
        self.ledger.add_micro_batch(loss)

    def end_of_step(self, grad_norm: Any, backend_skipped: bool = False, dropped: bool = False) -> torch.Tensor:
        """Combine the step's loss flag with the gradient norm, agree across ranks; return the device fault flag.
        `backend_skipped`: DeepSpeed, which steps inside `backward`, skipped the step itself. `dropped`: the step's
        batches were not trained (a poisoned step, see `restarts/step_progress.py`): a skipped step."""
        step = self.port.state.global_step + 1
        fault = self.flags.end_step(step, grad_norm, self.port.device, backend_skipped, dropped, self.riders)
        self.batches.end_step(step)
        self.ledger.end_step(fault)
        return fault

    def apply_skip(self, optimizer: Any) -> None:
        """Make `optimizer.step()` a no-op when the step is a fault (called after clipping, before the step)."""
        if not self.deepspeed:  # DeepSpeed skips them itself
            self.flags.skip_update(optimizer, self.backend.scaler if self.backend is not None else None)

    def after_update(self, optimizer: Any) -> None:
        """After `optimizer.step()`: take back what `apply_skip` handed the optimizer."""
        self.flags.after_update(optimizer)

    # ------------------------------------------------------------------ when to inspect, and the inspection
    def due(self, control: Any) -> tuple[bool, bool] | None:
        """Where the Trainer is about to log, evaluate or save (every step, before it does): `(verify, snapshot)` when
        an inspection is due ([`inspection_due`]), else `None`."""
        self.verified_step = -1  # callbacks after the guard's may have changed the state since it was last verified
        self.refresh_best_fields()
        step, pending, interval = self.port.state.global_step, len(self.flags.pending), self.interval
        interval.estimate(step, self.snapshotter, self.port, self.events)  # before a second snapshot
        return inspection_due(control, step, self.config, interval.ask(step), pending, interval.read_steps)

    def judge(self, verify: bool = False, snapshot: bool = False, fresh: bool = False) -> Judged | None:
        """Read the pending flags and judge them (checking the state when a step was bad, or `verify`); `fresh`: do
        not trust an earlier verification of this step. `None` when there is nothing to judge."""
        self.verified_step = -1 if fresh else self.verified_step
        if not self.flags.pending and not verify:
            return None
        records = self.flags.read()
        if any(r.overflow for r in records):
            records = unexplained_overflows(records, loss_scale(self.backend))
        any_bad = any(r.bad for r in records)
        with self.interval.timed(snapshot):  # a snapshot's check: part of its cost
            state_finite = self.state_verified() if (any_bad or verify) else True
        limit = self.settings.nan_max_consecutive_skips
        verdict = judge_window(records, self._consecutive, limit, self.deepspeed, state_finite)
        self._consecutive = verdict.consecutive
        judged = Judged(records, verdict, state_finite, snapshot=snapshot, step=self.port.state.global_step)
        # One diagnosis per run; with replay bundles, one per inspection that finds a fault (its bundle carries it).
        diagnosed = diagnosed_step(verdict) if not self.state.localized or self.bundles_on else None
        batches = self.batches.get(diagnosed)
        if batches:  # every rank holds the batches of the same steps, so all ranks replay together
            self.state.localized = True
            judged.replay, judged.replay_step = batches, diagnosed
        if self.bundles_on:
            judged.bundles, judged.dropped = bundles_for(judged, self.batches)
        return judged

    def settle(self, judged: Judged, diagnosis: dict[str, Any] | None = None) -> Decision:
        """Decide on an inspection: restore the last good state (and go on, or stop), or take a snapshot. Its events
        (with the `diagnosis` of the replayed step, if any) are recorded now, or, before a restore from memory, right
        after it ([`record`]): the state is restored first."""
        verdict = judged.verdict
        decision = Decision(verdict, records=judged.records, diagnosis=diagnosis if not verdict.skipped else None)
        decision.replayed = diagnosis
        if verdict.rollback is None:
            self.record(decision)
            if judged.snapshot and judged.state_finite and verdict.consecutive == 0:
                # Only right after an applied step: a rollback then restores the state before the fault.
                decision.publish_good_state = self.take_snapshot()
            return decision
        decision.restore = True
        decision.abort = not can_roll_back(self.rollbacks_this_run, self.settings.nan_max_rollbacks)
        if self.spikes is not None and spike_run_rolled_back(verdict):
            self.spikes.restart()  # warm up again on the run's level (also in the abort's saved state)
        self.refresh_best_fields()  # the snapshot's weights go back with the best-model fields of their time
        if self.snapshotter.may_load:  # before the load, which may find no good state left (`abort`)
            self.record(decision)
        decision.load = self.snapshotter.to_load(self.port.state.global_step)
        return decision

    def record(self, decision: Decision) -> None:
        """Record the inspection's events and counters once: before its `rollback`/`abort`, and if the restore fails."""
        if decision.recorded:
            return
        decision.recorded, verdict = True, decision.verdict
        record_window(self.events, verdict, decision.replayed, self.state, spikes_skipped=not self.deepspeed)
        self.ledger.record_skips(len(verdict.skipped) + len(verdict.spikes))
        self.batches.clear()

    def restore(self, decision: Decision) -> Restored:
        """Put the last good state back (after the caller loaded `decision.load`, if any), back the learning rate off
        and count it; record the `rollback` event unless the run stops (`decision.abort`)."""
        try:
            with self.clock.paused():  # a copy of the whole state: not timed as part of the step
                restored = restore_last_good(self.port, self.snapshotter, self.settings.nan_lr_backoff)
        finally:
            self.record(decision)  # the window's events, before the `rollback` (or `abort`) event
        self.state.lr_scale *= restored.lr_factor
        self.state.count_discarded(restored.discarded_steps)
        self.verified_step = restored.at_step  # verified when it was taken
        self._consecutive = 0
        self.interval.restart()  # the restore is no step's time
        self.flags.clear()
        self.batches.clear()
        if not decision.abort:
            self.state.rollbacks += 1
            self.rollbacks_this_run += 1
            facts = (decision.verdict, decision.records, decision.diagnosis, restored, self.state.rollbacks)
            record_rollback(self.events, *facts, self.damaged_ranks, max_steps=self.port.state.max_steps)
        return restored

    def diverged(self, decision: Decision, restored: Restored, checkpoint: str | None) -> TrainingDivergedError:
        """The run stops over the restored state saved as `checkpoint` (`None`: failed): record it, return the error."""
        facts = (decision.verdict, restored, self.state, self.rollbacks_this_run, self.settings.nan_max_rollbacks)
        return diverged_error(self.events, *facts, checkpoint)

    # ------------------------------------------------------------------ the end
    def check_at_end(self, best: str | None = None) -> EndRestore | None:
        """When `train()` returns, after every callback: verify once more (every rank). `None` when the state is
        finite; else what the caller loads before [`restored_at_end`] (`best`: the best checkpoint the Trainer loads
        at the end with `load_best_model_at_end`, if any)."""
        self.verified_step = -1
        if self.snapshotter is None or self.state_is_finite():
            return None
        return EndRestore(best=best) if best else EndRestore(load=self.snapshotter.to_load(self.port.state.global_step))

    def restored_at_end(self, end: EndRestore) -> Restored:
        """Put the last good state back over one damaged after the last check (`end` loaded): a `restore` event."""
        with self.clock.paused():
            restored = record_end_restore(self.port, self.snapshotter, self.events, end.best, self.damaged_ranks)
        self.verified_step = restored.at_step
        return restored

    def state_is_finite(self) -> bool:
        """Whether the weights and optimizer state are finite on every rank (a collective and a host sync); the ranks
        whose own state is not are kept in `self.damaged_ranks`."""
        finite = all_finite(state_tensors(self.backend, self.port.model)).to(self.port.device)
        self.damaged_ranks = [rank for ranks in ranks_with_flag((~finite).reshape(1)) for rank in ranks]
        # A check that finds damage takes back an earlier verification of this step.
        self.verified_step = -1 if self.damaged_ranks else self.port.state.global_step
        return not self.damaged_ranks

    def state_verified(self) -> bool:
        """Whether the state is known finite at this step (checked now unless already verified)."""
        return self.verified_step == self.port.state.global_step or self.state_is_finite()

    def take_snapshot(self) -> bool:
        """Keep the state as the last good one; whether the caller must publish it (the disk source's first)."""
        with self.clock.paused(), self.interval.timed():  # a copy of the whole state: not timed with the step
            self.snapshotter.take(self.port.state)
        self.interval.after_snapshot(self.port.state, self.snapshotter, self.port, self.events)
        self._refresh_best = True  # after this step's evaluation and save (same weights), at the next boundary
        return self.snapshotter.needs_checkpoint(self.port.state.global_step)

    def refresh_best_fields(self) -> None:
        """Record the best-model fields with the snapshot taken before this step's evaluation and save."""
        if self._refresh_best and self.snapshotter is not None:
            self.snapshotter.refresh_best_fields(self.port.state)
            self._refresh_best = False

    def published(self, path: str) -> None:
        """A verified checkpoint of this run was published at `path` (a good state; a source of frozen parameters)."""
        if self.snapshotter is not None:
            self.snapshotter.published(path)


__all__ = ["NanGuard"]
