"""The last good state kept on disk: a rollback reloads the newest verified checkpoint instead of a host copy.

For runs whose weights and optimizer state do not fit in host memory next to training (large full fine-tunes),
`nan_rollback_from="checkpoint"` keeps no snapshot in memory. A rollback then loads the weights and optimizer state of
the newest checkpoint this run published (every checkpoint is verified finite before it is published, see
`trainer_hooks.py`), through the Trainer's own resume code, so every backend that resumes (single process, DDP,
DeepSpeed ZeRO, FSDP2, PEFT adapters) rolls back the same way. The contract is the in-memory one (weights and
optimizer state come back, with the best-model fields of that checkpoint; `global_step`, the data position, the LR
schedule and the RNG streams go on), at the cost of a slower restore and of discarding the steps since the last
checkpoint rather than since the last snapshot. A run that has no checkpoint yet publishes one when training starts
(`checkpoint-<step>`, e.g. `checkpoint-0`), so there is always a good state to go back to.
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers.integrations.deepspeed import deepspeed_load_checkpoint

from .checkpoint import checkpoint_step, checkpoints
from .snapshot import BEST_MODEL_FIELDS, Snapshot, _groups

TRAINER_STATE_FILE = "trainer_state.json"


def newest_checkpoint(run_dir: str, at_most: int) -> str | None:
    """The newest published `checkpoint-N` of `run_dir` with `N <= at_most` (a checkpoint of a later, discarded
    timeline is never a rollback target), or `None`."""
    found = [path for path in checkpoints(run_dir) if checkpoint_step(path) <= at_most]
    return found[-1] if found else None


class CheckpointSnapshotter:
    """Takes no copy; restores the newest published checkpoint of the run (same interface as [`Snapshotter`]).

    Args:
        trainer (`transformers.Trainer`): the trainer whose checkpoints are the good states.
        optimizer: the optimizer the guard checks (torch's, or DeepSpeed's ZeRO optimizer).
        deepspeed_stage (`int | None`): the ZeRO stage when DeepSpeed owns the optimizer, else `None`.
    """

    def __init__(self, trainer: Any, optimizer: Any, deepspeed_stage: int | None = None):
        self.trainer = trainer
        self.model = trainer.model
        self.optimizer = optimizer
        self.deepspeed_stage = deepspeed_stage
        self.snapshot = Snapshot()

    def run_dir(self) -> str:
        return self.trainer._get_output_dir(trial=None)

    def take(self, state: Any) -> Snapshot:
        """Record that the state of this step is good; at the first call of a run with no checkpoint at or before
        this step, publish one (the only good state there is to go back to)."""
        if newest_checkpoint(self.run_dir(), state.global_step) is None:
            self.trainer._save_checkpoint(self.trainer.model_wrapped, trial=None)
        self.snapshot.step = state.global_step
        return self.snapshot

    def refresh_best_fields(self, state: Any) -> None:
        """Nothing to refresh: a restore takes the best-model fields from the checkpoint it loads."""

    def restore(self, state: Any) -> Snapshot:
        """Load the weights and optimizer state of the newest checkpoint at or before this step, keep the LR schedule
        and the optimizer's hyperparameters as they are now, and take the checkpoint's best-model fields."""
        trainer = self.trainer
        path = newest_checkpoint(self.run_dir(), state.global_step)
        if path is None:
            raise RuntimeError(
                f"No good state to restore: no published checkpoint at or before step {state.global_step} in "
                f"{self.run_dir()}."
            )
        schedule = trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None
        live_groups = [{k: v for k, v in g.items() if k != "params"} for g in _groups(self.optimizer)]
        # What the Trainer does when it resumes inside its training loop, once the model is wrapped.
        if trainer.is_deepspeed_enabled:  # the engine loads its optimizer (and scheduler) with the weights
            strict = getattr(trainer.model, "peft_config", None) is None
            deepspeed_load_checkpoint(trainer.model_wrapped, path, load_module_strict=strict)
        else:
            trainer._load_from_checkpoint(path, trainer.model_wrapped if trainer.is_fsdp_enabled else None)
        trainer._load_optimizer_and_scheduler(path)
        if schedule is not None:
            trainer.lr_scheduler.load_state_dict(schedule)
        for group, live in zip(_groups(self.optimizer), live_groups):
            group.update(live)  # the LR follows the schedule position, which a rollback does not rewind
        with open(os.path.join(path, TRAINER_STATE_FILE)) as f:
            saved = json.load(f)
        for key in BEST_MODEL_FIELDS:
            setattr(state, key, saved.get(key))
        self.snapshot.step = checkpoint_step(path)
        return self.snapshot


__all__ = ["CheckpointSnapshotter", "newest_checkpoint"]
