"""`NanGuard`: keeps non-finite updates out of the weights and rolls back to the last good state.

Per optimizer step (hot path, no host-device synchronisation):
  * each micro-batch loss is folded into a device flag (`observe_loss`);
  * after gradient clipping, the flag is combined with the gradient norm, agreed across ranks with a one-element
    all-reduce, and kept on the device (`end_of_step`);
  * before `optimizer.step()` the flag is handed to the optimizer (`apply_skip`): fused torch optimizers take it as
    `found_inf` and skip the update on the device, weights and optimizer state untouched. Other optimizers fall back to
    one host read of the flag and drop the gradients. Under DeepSpeed the engine skips non-finite steps itself.
At inspection points (steps where the trainer logs, saves or evaluates anyway, and every `nan_snapshot_steps`), the
flags are read back in one transfer and judged by the pure policy (`policy.judge_window`): skips are recorded, and a
run of skips, a confirmed loss spike or a non-finite state triggers a rollback to the last snapshot, taken from a
verified-finite state every `nan_snapshot_steps` steps.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TrainingDivergedError
from .checkpoint import all_finite, optimizer_tensors
from .collectives import agree_any, distributed, ranks_with_flag
from .events import EventLog, NanEvent
from .localize import first_nonfinite_module
from .policy import SpikeDetector, StepRecord, Verdict, can_roll_back, judge_window
from .snapshot import Snapshotter, scale_learning_rate


logger = logging.getLogger("safe_trainers")
GUARD_STATE_FILE = "nan_guard_state.json"


class NanGuard:
    """The NaN guard of one trainer.

    Args:
        trainer (`transformers.Trainer`): the trainer it protects (a `safe_trainers` trainer).
        settings ([`SafetyArguments`]): the `nan_*` settings.
    """

    def __init__(self, trainer: Any, settings: Any):
        self.trainer = trainer
        self.settings = settings
        self.events = EventLog(trainer.args.output_dir, write=trainer.is_world_process_zero())
        self.spike = SpikeDetector(settings.nan_spike_factor, settings.nan_spike_patience) if settings.nan_spike_factor else None
        self.skipped_steps = 0
        self.rollbacks = 0
        self.consecutive = 0
        self.lr_scale = 1.0
        self.localized = False
        self.replaying = False
        self.aborting = False
        self.damaged_ranks: list[int] = []
        self.verified_step = -1
        self.snapshotter: Snapshotter | None = None
        self._reset_step()
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._batches: dict[int, list[Any]] = {}
        self._batch_positions: dict[int, tuple[int, int]] = {}
        self._micro_batches_seen = 0
        self._bad_now: torch.Tensor | None = None

    # ------------------------------------------------------------------ lifecycle
    def begin(self) -> None:
        """Called at `on_train_begin`: bind to the optimizer and take the first snapshot."""
        trainer = self.trainer
        stage = None
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if trainer.is_deepspeed_enabled:
            stage = trainer.accelerator.state.deepspeed_plugin.zero_stage
            optimizer = trainer.model_wrapped.optimizer
            if stage == 0:
                raise ValueError(
                    "`nan_guard=True` supports DeepSpeed ZeRO stages 1, 2 and 3, got stage 0. Use ZeRO, or plain DDP, "
                    "or set `nan_guard=False`."
                )
        self.snapshotter = Snapshotter(trainer.model, optimizer, stage)
        self._pending.clear()
        self._batches.clear()
        self._reset_step()
        self.take_snapshot()

    def load_state(self, checkpoint_dir: str) -> None:
        """Restore the guard's counters saved with a checkpoint (resume after a crash)."""
        path = os.path.join(checkpoint_dir, GUARD_STATE_FILE)
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            self.skipped_steps = saved.get("skipped_steps", 0)
            self.rollbacks = saved.get("rollbacks", 0)
            self.lr_scale = saved.get("lr_scale", 1.0)
            self.localized = saved.get("localized", False)

    def save_state(self, checkpoint_dir: str) -> None:
        state = {
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "localized": self.localized,
        }
        with open(os.path.join(checkpoint_dir, GUARD_STATE_FILE), "w") as f:
            json.dump(state, f)

    def log_counters(self) -> dict[str, int]:
        return {"nan_guard/skipped_steps": self.skipped_steps, "nan_guard/rollbacks": self.rollbacks}

    # ------------------------------------------------------------------ hot path (no host sync)
    def observe_loss(self, loss: torch.Tensor, inputs: Any) -> None:
        """Fold one micro-batch loss into the step's flags; keep a reference to the batch for diagnosis."""
        value = loss.detach().float()
        bad = ~torch.isfinite(value).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        value = value.sum()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._step_inputs.append(inputs)
        self._micro_batches_seen += 1

    def end_of_step(self, grad_norm: Any) -> torch.Tensor:
        """Combine the step's loss flag with the gradient norm and agree across ranks. Returns the device flag."""
        device = self.trainer.args.device
        local = self._loss_bad if self._loss_bad is not None else torch.zeros((), dtype=torch.bool, device=device)
        norm = grad_norm if torch.is_tensor(grad_norm) else torch.tensor(
            float("nan") if grad_norm is None else float(grad_norm), device=device
        )
        norm = norm.detach().float().to(local.device)
        bad = local | ~torch.isfinite(norm)
        if self.snapshotter is not None and self.snapshotter.deepspeed_stage is not None:
            # DeepSpeed has already stepped (inside `backward`); it skips steps with a non-finite gradient norm.
            bad = bad | torch.tensor(bool(self.trainer.accelerator.optimizer_step_was_skipped), device=local.device)
        bad = agree_any(bad)
        loss = self._loss_sum if self._loss_sum is not None else torch.zeros((), device=local.device)
        step = self.trainer.state.global_step + 1
        self._pending.append((step, bad, local, loss, norm))
        self._batches[step] = self._step_inputs
        first = self._micro_batches_seen - len(self._step_inputs)
        self._batch_positions[step] = (first, self._micro_batches_seen - 1)
        for old in [s for s in self._batches if s <= step - self.settings.nan_snapshot_steps]:
            del self._batches[old]  # batch references (memory) are kept for the last steps only
        self._bad_now = bad
        self._reset_step()
        return bad

    def apply_skip(self, optimizer: Any) -> None:
        """Make `optimizer.step()` a no-op when the step is bad (called after clipping, before the step)."""
        if self._bad_now is None or (self.snapshotter and self.snapshotter.deepspeed_stage is not None):
            return
        inner = getattr(optimizer, "optimizer", optimizer)
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if getattr(inner, "_step_supports_amp_scaling", False) and scaler is None:
            # Fused optimizers skip on the device when `found_inf` is set, and undo their step counter.
            inner.found_inf = self._bad_now.to(torch.float32)
        elif bool(self._bad_now):  # one host read: this optimizer cannot skip on the device
            for group in inner.param_groups:
                for param in group["params"]:
                    param.grad = None

    # ------------------------------------------------------------------ inspection
    def inspection_due(self, control: Any) -> bool:
        step = self.trainer.state.global_step
        return bool(
            control.should_log
            or control.should_save
            or control.should_evaluate
            or control.should_training_stop
            or step % self.settings.nan_snapshot_steps == 0
            or len(self._pending) >= self.settings.nan_snapshot_steps
        )

    def inspect(self, control: Any) -> Verdict | None:
        """Read the pending flags, record skips, roll back or abort if needed, take a snapshot when due."""
        if not self._pending:
            return None
        records = self._read_pending()
        any_bad = any(r.bad for r in records)
        step = self.trainer.state.global_step
        snapshot_due = step % self.settings.nan_snapshot_steps == 0
        self.damaged_ranks = []
        state_finite = self.state_is_finite() if (any_bad or snapshot_due) else True
        verdict = judge_window(records, self.consecutive, self.settings.nan_max_consecutive_skips, self.spike, state_finite)
        self.consecutive = verdict.consecutive
        diagnosis = None
        if (verdict.skipped or verdict.rollback) and not self.localized:
            fault = verdict.skipped[0].step if verdict.skipped else verdict.fault_step
            diagnosis = self._localize(fault)
        for i, record in enumerate(verdict.skipped):
            self.skipped_steps += 1
            detail = {"loss": record.loss, "grad_norm": record.grad_norm, "batches": self._positions(record.step)}
            if i == 0 and diagnosis is not None:
                detail["first_nonfinite_module"] = diagnosis
            self.events.add(NanEvent(record.step, "skip", record.what, list(record.bad_ranks), detail))
        if verdict.skipped:
            logger.warning(
                f"NaN guard: {len(verdict.skipped)} update(s) with a non-finite loss or gradient were not applied "
                f"(steps {[r.step for r in verdict.skipped]}). See {self.events.path}."
            )
        if verdict.rollback is not None:
            if can_roll_back(self.rollbacks, self.settings.nan_max_rollbacks):
                self.rollback(verdict, records, diagnosis if not verdict.skipped else None)
                control.should_save = False
                control.should_evaluate = False
            else:
                self.abort(verdict)
        elif snapshot_due and state_finite and verdict.consecutive == 0:
            # Only right after an applied step: a snapshot taken during a run of skips would let the next rollback
            # land inside the fault.
            self.take_snapshot()
        return verdict

    def _read_pending(self) -> list[StepRecord]:
        pending, self._pending = self._pending, []
        steps = [p[0] for p in pending]
        local = torch.stack([p[2] for p in pending])
        table = torch.stack(
            [torch.stack([p[1].float(), p[3].float(), p[4].float()]) for p in pending]
        ).cpu()  # the one device-to-host transfer of an inspection
        bad = [bool(flag) for flag in table[:, 0].tolist()]
        losses, norms = table[:, 1].tolist(), table[:, 2].tolist()
        ranks = [[] for _ in pending]
        if any(bad):
            ranks = ranks_with_flag(local)
        return [StepRecord(s, l, n, b, tuple(r)) for s, l, n, b, r in zip(steps, losses, norms, bad, ranks)]

    def state_is_finite(self) -> bool:
        """Whether the weights and optimizer state are finite on every rank (a host sync; not on the hot path).

        The ranks whose own state is non-finite are kept in `self.damaged_ranks`.
        """
        snap = self.snapshotter
        if snap is not None and snap.deepspeed_stage is not None:
            tensors = _deepspeed_tensors(snap.optimizer, snap.deepspeed_stage)
        else:
            opt = snap.optimizer if snap is not None else getattr(self.trainer.optimizer, "optimizer", None)
            tensors = list(self.trainer.model.parameters()) + (optimizer_tensors(opt) if opt is not None else [])
        finite = all_finite(tensors).to(self.trainer.args.device)
        self.damaged_ranks = [rank for ranks in ranks_with_flag((~finite).reshape(1)) for rank in ranks]
        if not self.damaged_ranks:
            self.verified_step = self.trainer.state.global_step
        return not self.damaged_ranks

    def state_verified(self) -> bool:
        """Whether the state is known finite at this step (checked now unless an inspection already did)."""
        return self.verified_step == self.trainer.state.global_step or self.state_is_finite()

    # ------------------------------------------------------------------ actions
    def take_snapshot(self) -> None:
        trainer = self.trainer
        snap = self.snapshotter.take(trainer.state, trainer.lr_scheduler, trainer.accelerator.scaler, self.lr_scale)
        # A rollback never goes further back than this snapshot: older batch positions are no longer needed.
        for old in [s for s in self._batch_positions if s <= snap.step]:
            del self._batch_positions[old]

    def rollback(self, verdict: Verdict, records: list[StepRecord], diagnosis: dict | None) -> None:
        trainer = self.trainer
        current = trainer.state.global_step
        snap = self.snapshotter.restore(trainer.state, trainer.lr_scheduler, trainer.accelerator.scaler)
        self.lr_scale *= self.settings.nan_lr_backoff
        lr = scale_learning_rate(
            getattr(trainer.optimizer, "optimizer", trainer.optimizer), trainer.lr_scheduler, self.lr_scale / snap.lr_scale
        )
        self.rollbacks += 1
        self.consecutive = 0
        self.verified_step = -1
        if self.spike is not None:
            self.spike.reset()
        # The loss accumulated since the last log belongs to steps that no longer exist.
        trainer._tr_loss.zero_()
        trainer._globalstep_last_logged = min(trainer._globalstep_last_logged, snap.step)
        bad = [r for r in records if r.bad]
        what = sorted({w for r in bad for w in r.what}) or (["loss_spike"] if verdict.rollback == "loss_spike" else [])
        if verdict.rollback == "nonfinite_state":
            what = sorted(set(what) | {"weights_or_optimizer_state"})
        skipped_batches = [self._positions(s) for s in range(snap.step + 1, current + 1) if s in self._batch_positions]
        detail = {
            "reason": verdict.rollback,
            "fault_step": verdict.fault_step,
            "restored_step": snap.step,
            "skipped_batches": skipped_batches,
            "learning_rate": lr,
            "rollbacks": self.rollbacks,
        }
        if diagnosis is not None:
            detail["first_nonfinite_module"] = diagnosis
        ranks = sorted({rank for r in bad for rank in r.bad_ranks} | set(self.damaged_ranks))
        self.events.add(NanEvent(current, "rollback", what, ranks, detail))
        logger.warning(
            f"NaN guard: rolled back from step {current} to step {snap.step} ({verdict.rollback}); the batches of "
            f"step{'s' if current > snap.step + 1 else ''} {snap.step + 1}{f'-{current}' if current > snap.step + 1 else ''} "
            f"are skipped and the learning rate is now {lr:.3g}."
        )
        self._pending.clear()
        self._batches.clear()

    def abort(self, verdict: Verdict) -> None:
        trainer = self.trainer
        current = trainer.state.global_step
        snap = self.snapshotter.restore(trainer.state, trainer.lr_scheduler, trainer.accelerator.scaler)
        checkpoint = None
        self.aborting = True
        try:
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
            checkpoint = os.path.join(trainer._get_output_dir(trial=None), f"checkpoint-{trainer.state.global_step}")
        except Exception as error:  # report, but never hide the divergence behind a save error
            logger.error(f"NaN guard: could not save the last good state: {error}")
        self.events.add(
            NanEvent(
                current,
                "abort",
                [verdict.rollback or "unknown"],
                [],
                {
                    "reason": verdict.rollback,
                    "fault_step": verdict.fault_step,
                    "restored_step": snap.step,
                    "rollbacks": self.rollbacks,
                    "checkpoint": checkpoint,
                },
            )
        )
        raise TrainingDivergedError(
            f"Training diverged: step {verdict.fault_step} started a fault ({verdict.rollback}) after "
            f"{self.rollbacks} rollback(s) (`nan_max_rollbacks={self.settings.nan_max_rollbacks}`). The last good state "
            f"(step {snap.step}) was saved to {checkpoint}; every event is in {self.events.path}. Lower the learning "
            "rate, check the data around the listed batches, or raise `nan_max_rollbacks`.",
            checkpoint_dir=checkpoint,
            report_path=self.events.path,
        )

    def refuse_save(self, step: int) -> None:
        """Record that a checkpoint was not written because the state is non-finite."""
        self.events.add(NanEvent(step, "save_refused", ["weights_or_optimizer_state"], [], {}))
        logger.error(
            f"NaN guard: checkpoint-{step} was NOT written: the weights or optimizer state are non-finite. The last "
            "clean checkpoint is kept."
        )

    def record_rewards(self, nonfinite: int, total: int, whole_groups: int) -> None:
        """GRPO: some rewards came back NaN/None/Inf (called with gathered counts, identical on every rank)."""
        self.events.add(
            NanEvent(
                self.trainer.state.global_step + 1,
                "reward",
                ["rewards"],
                [],
                {"nonfinite_rewards": nonfinite, "completions": total, "unscorable_groups": whole_groups},
            )
        )

    # ------------------------------------------------------------------ helpers
    def _reset_step(self) -> None:
        self._loss_bad: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._step_inputs: list[Any] = []

    def _positions(self, step: int) -> dict[str, int] | None:
        span = self._batch_positions.get(step)
        return None if span is None else {"first_micro_batch": span[0], "last_micro_batch": span[1]}

    def _localize(self, step: int | None) -> dict[str, Any] | None:
        batches = self._batches.get(step) if step is not None else None
        if not batches:  # every rank holds the batches of the same steps, so all ranks return here together
            return None
        self.localized = True
        trainer = self.trainer
        model = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model
        self.replaying = True
        try:
            result = first_nonfinite_module(trainer.model, lambda: trainer.compute_loss(model, batches[0]))
        finally:
            self.replaying = False
        result["rank"] = trainer.args.process_index
        if distributed():
            # Each rank replayed its own batch: report the rank where the forward pass went non-finite.
            results: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(results, result)
            result = next((r for r in results if r.get("module")), results[0])
        result["step"] = step
        return result


def _deepspeed_tensors(optimizer: Any, stage: int) -> list[torch.Tensor]:
    if stage == 3:
        tensors = list(optimizer.fp32_partitioned_groups_flat) + list(optimizer.fp16_partitioned_groups_flat)
        tensors += [p.data for p in getattr(optimizer, "persistent_parameters", [])]
    else:
        tensors = list(optimizer.single_partition_of_fp32_groups) + list(optimizer.bit16_groups_flat)
    return tensors + optimizer_tensors(optimizer.optimizer)


__all__ = ["GUARD_STATE_FILE", "NanGuard"]
