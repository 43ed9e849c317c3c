"""The last good state kept on disk: a rollback reloads the newest verified checkpoint instead of a host copy.

For runs whose weights and optimizer state do not fit in host memory next to training (large full fine-tunes),
`nan_rollback_from="checkpoint"` keeps no snapshot in memory. A rollback then loads the weights and optimizer state
of the newest checkpoint this run published or resumed from (every checkpoint is verified finite before it is
published, see `trainer/hooks.py`), through the Trainer's own resume code (the integration layer loads it,
`trainer/checkpoint_rollback.py`: this module chooses it and keeps the books), so every backend that resumes (single
process, DDP, DeepSpeed ZeRO, FSDP2, PEFT adapters) rolls back the same way. An earlier run's checkpoints left in the
same `output_dir` are never used. The contract is the in-memory one (weights and optimizer state come back, with the
best-model fields of that checkpoint; `global_step`, the data position, the LR schedule and the RNG streams go on; a
damaged frozen parameter is repaired from its files, `frozen.py`), at the cost of a slower restore and of discarding
the steps since the last checkpoint rather than since the last snapshot. A run that has no checkpoint yet publishes
one when training starts (`checkpoint-<step>`, e.g. `checkpoint-0`), so there is always a good state to go back to.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers.trainer import TRAINER_STATE_NAME

from ...errors import TrainingDivergedError
from ...runtime.checkpoint_dirs import checkpoint_step
from ...runtime.events import EventLog, RunEvent
from ..backends import Backend
from .frozen import repair_frozen
from .source import BEST_MODEL_FIELDS, Snapshot


class CheckpointSource:
    """Takes no copy; names the newest checkpoint of this run's timeline for the caller to load, and keeps the books
    of a restore from it (a [`RollbackSource`], like [`HostSnapshot`]).

    Only checkpoints this run published, and the checkpoint it resumed from, are good states: an earlier run's
    checkpoints left in the same `output_dir` never are.

    Args:
        model (`torch.nn.Module`): the unwrapped model (a damaged frozen parameter is repaired from the checkpoints).
        backend ([`Backend`]): what the guard bound to: the optimizer it checks (torch's, or DeepSpeed's ZeRO
            optimizer) and the ZeRO stage.
        events ([`EventLog`]): the run's event log (an `abort` event when no good state is left).
        output_dir (`str`): where the run publishes (named when no good state is left).
        resumed_from (`str | None`): the checkpoint `train()` resumed from, if any.
    """

    may_load = True  # every rollback loads a checkpoint

    def __init__(
        self,
        model: torch.nn.Module,
        backend: Backend,
        events: EventLog,
        output_dir: Any,
        resumed_from: str | None = None,
    ):
        self.model = model
        self.backend = backend
        self.events = events
        self.output_dir = output_dir
        self.snapshot = Snapshot()
        self.good: list[str] = []
        self.loading: str | None = None  # the checkpoint `to_load` named last
        if resumed_from is not None and os.path.isdir(resumed_from):
            self.good.append(resumed_from)

    def published(self, path: str) -> None:
        """The trainer published a verified checkpoint of this run."""
        self.good.append(path)

    @property
    def checkpoints(self) -> list[str]:
        """The good checkpoints, oldest first: where a damaged frozen parameter may be restored from."""
        return self.good

    def newest_good(self, at_most: int) -> str | None:
        """The newest good checkpoint at or before step `at_most` still on disk (rotation may have removed some)."""
        found = [p for p in self.good if os.path.isdir(p) and (checkpoint_step(p) or 0) <= at_most]
        return max(found, key=lambda p: checkpoint_step(p) or 0) if found else None

    def take(self, state: Any) -> Snapshot:
        """Record that the state of this step is good (published as a checkpoint when [`needs_checkpoint`])."""
        self.snapshot.step = state.global_step
        return self.snapshot

    def copy_delay_seconds(self) -> float | None:
        """No copy: the good state is a checkpoint the trainer publishes anyway."""
        return 0.0

    def allocation_seconds(self) -> float:
        """None: no host buffers."""
        return 0.0

    def needs_checkpoint(self, step: int) -> bool:
        """Whether the good state of `step` must be published as a checkpoint: no good checkpoint at or before it
        (a run's first good state, with nothing resumed from)."""
        return self.newest_good(step) is None

    def refresh_best_fields(self, state: Any) -> None:
        """Nothing to refresh: a restore takes the best-model fields from the checkpoint it loads."""

    def before_write(self) -> None:
        """Nothing in flight: the state is kept by the checkpoints the trainer saves."""

    def to_load(self, step: int) -> str:
        """The newest good checkpoint at or before `step`, which the caller loads before [`restore`]; when none is
        left, the run stops ([`TrainingDivergedError`], with an `abort` event)."""
        path = self.newest_good(step)
        if path is None:
            detail = {"reason": "no_good_state", "good": list(self.good)}
            self.events.add(RunEvent(step, "abort", ["weights_or_optimizer_state"], [], detail))
            message = no_good_state_message(self.good, step, self.output_dir)
            raise TrainingDivergedError(message, checkpoint_dir=None, report_path=self.events.path)
        self.loading = path
        return path

    def restore(self, state: Any) -> Snapshot:
        """After the caller loaded the weights and optimizer state of [`to_load`]'s checkpoint (keeping the LR
        schedule and the optimizer's hyperparameters as they are now): take the checkpoint's best-model fields, and
        repair a damaged parameter it does not hold (a PEFT checkpoint holds the adapters only)."""
        # The checkpoint `to_load` named and the caller loaded (not looked up again: it may be rotated away since).
        path, self.loading = self.loading or self.newest_good(state.global_step), None
        with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
            saved = json.load(f)
        for key in BEST_MODEL_FIELDS:
            setattr(state, key, saved.get(key))
        self.snapshot.step = checkpoint_step(path) or 0
        repair_frozen(self.model, self.checkpoints, state.global_step)
        return self.snapshot


def no_good_state_message(good: list[str], step: int, output_dir: str) -> str:
    """Why a rollback from disk cannot happen: every good checkpoint of the run is gone from disk."""
    listed = ", ".join(f"`{os.path.basename(p)}`" for p in good) or "none"
    return (
        f"Training diverged at step {step} and the NaN guard has no good state to roll back to: "
        f'`nan_rollback_from="checkpoint"` restores the newest checkpoint this run published or resumed from, at or '
        f"before step {step}, and none is left in {output_dir} (this run's: {listed}; deleted since by something "
        "other than this run's rotation, which keeps its newest). Nothing was saved. Resume from a checkpoint you "
        "trust with `trainer.train(resume_from_checkpoint=...)`, or keep the good state in host memory with "
        '`nan_rollback_from="memory"`.'
    )


__all__ = ["CheckpointSource", "no_good_state_message"]
