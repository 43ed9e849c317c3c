"""The last good state kept on disk: a rollback reloads the newest verified checkpoint instead of a host copy.

For runs whose weights and optimizer state do not fit in host memory next to training (large full fine-tunes),
`nan_rollback_from="checkpoint"` keeps no snapshot in memory. A rollback then loads the weights and optimizer state
of the newest checkpoint this run published or resumed from (every checkpoint is verified finite before it is
published, see `trainer_hooks.py`), through the Trainer's own resume code, so every backend that resumes (single
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
from collections.abc import Callable
from typing import Any

from transformers.integrations.deepspeed import deepspeed_load_checkpoint
from transformers.trainer import TRAINER_STATE_NAME

from ..errors import TrainingDivergedError
from .backends import Backend
from .checkpoint_dirs import checkpoint_step
from .events import EventLog, NanEvent
from .frozen import repair_frozen
from .good_state import BEST_MODEL_FIELDS, Snapshot, kept_hyperparameters


class CheckpointSnapshotter:
    """Takes no copy; restores the newest checkpoint of this run's timeline (a [`RollbackSource`], like
    [`Snapshotter`]).

    Only checkpoints this run published, and the checkpoint it resumed from, are good states: an earlier run's
    checkpoints left in the same `output_dir` never are.

    Args:
        trainer (`transformers.Trainer`): the trainer whose checkpoints are the good states, and whose own resume code
            loads them.
        backend ([`Backend`]): what the guard bound to: the optimizer it checks (torch's, or DeepSpeed's ZeRO
            optimizer) and the ZeRO stage.
        events ([`EventLog`]): the guard's event log (an `abort` event when no good state is left).
        save_starting_checkpoint (`Callable[[], None]`): publishes the state training starts from as a checkpoint
            (and calls [`published`] with it), for a run that has none yet.
        resumed_from (`str | None`): the checkpoint `train()` resumed from, if any.
    """

    def __init__(
        self,
        trainer: Any,
        backend: Backend,
        events: EventLog,
        save_starting_checkpoint: Callable[[], None],
        resumed_from: str | None = None,
    ):
        self.trainer = trainer
        self.backend = backend
        self.optimizer = backend.optimizer
        self.events = events
        self.save_starting_checkpoint = save_starting_checkpoint
        self.snapshot = Snapshot()
        self.good: list[str] = []
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
        """Record that the state of this step is good; at the first call of a run with no good checkpoint at or
        before this step, publish one (the only good state there is to go back to)."""
        if self.newest_good(state.global_step) is None:
            self.save_starting_checkpoint()  # calls `published`
        self.snapshot.step = state.global_step
        return self.snapshot

    def refresh_best_fields(self, state: Any) -> None:
        """Nothing to refresh: a restore takes the best-model fields from the checkpoint it loads."""

    def restore(self, state: Any) -> Snapshot:
        """Load the weights and optimizer state of the newest good checkpoint at or before this step, keep the LR
        schedule and the optimizer's hyperparameters as they are now, and take the checkpoint's best-model fields. A
        checkpoint saved without optimizer state (`save_only_model=True`) resets the optimizer state instead."""
        trainer = self.trainer
        path = self.newest_good(state.global_step)
        if path is None:
            events = self.events
            detail = {"reason": "no_good_state", "good": list(self.good)}
            events.add(NanEvent(state.global_step, "abort", ["weights_or_optimizer_state"], [], detail))
            message = no_good_state_message(self.good, state.global_step, trainer.args.output_dir)
            raise TrainingDivergedError(message, checkpoint_dir=None, report_path=events.path)
        schedule = trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None
        with_optimizer = any(name.startswith("optimizer") for name in os.listdir(path))
        # What the Trainer does when it resumes inside its training loop, once the model is wrapped.
        with kept_hyperparameters(self.optimizer):
            if self.backend.zero_stage is not None:  # the engine loads its optimizer (and scheduler) with the weights
                strict = getattr(trainer.model, "peft_config", None) is None
                deepspeed_load_checkpoint(trainer.model_wrapped, path, load_module_strict=strict)
            else:
                trainer._load_from_checkpoint(path, trainer.model_wrapped if trainer.is_fsdp_enabled else None)
                if not (with_optimizer and trainer.is_fsdp_enabled):
                    # The live moments are dropped before the checkpoint's are loaded, not held alongside them (twice
                    # the optimizer state at once, on the GPU under DDP); without optimizer state in the checkpoint,
                    # fresh moments, as a run resumed from such a checkpoint has. FSDP2's loader reads the live
                    # state's layout.
                    self.optimizer.state.clear()
                if with_optimizer:
                    trainer._load_optimizer_and_scheduler(path)
            if schedule is not None:
                trainer.lr_scheduler.load_state_dict(schedule)
        with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
            saved = json.load(f)
        for key in BEST_MODEL_FIELDS:
            setattr(state, key, saved.get(key))
        self.snapshot.step = checkpoint_step(path) or 0
        repair_frozen(trainer.model, self.checkpoints, state.global_step)  # a PEFT checkpoint holds the adapters only
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


__all__ = ["CheckpointSnapshotter"]
