"""A rollback from disk (`nan_rollback_from="checkpoint"`): load the weights and optimizer state of the checkpoint the
guard names, through the Trainer's own resume code, as the Trainer does when it resumes inside its training loop
(the model wrapped), with the LR schedule and the optimizer's hyperparameters kept as they are now. The guard keeps
the books of the restore (`guard/rollback/checkpoint.py`)."""

from __future__ import annotations

import os
from typing import Any

from transformers.integrations.deepspeed import deepspeed_load_checkpoint

from ..guard import Backend, kept_hyperparameters


def load_good_checkpoint(trainer: Any, path: str, backend: Backend) -> None:
    """Load `path`'s weights and optimizer state into the training `trainer` (bound to `backend`). A checkpoint saved
    without optimizer state (`save_only_model=True`) resets the optimizer state instead."""
    schedule = trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None
    with_optimizer = any(name.startswith("optimizer") for name in os.listdir(path))
    with kept_hyperparameters(backend.optimizer):
        if backend.zero_stage is not None:  # the engine loads its optimizer (and scheduler) with the weights
            strict = getattr(trainer.model, "peft_config", None) is None
            deepspeed_load_checkpoint(trainer.model_wrapped, path, load_module_strict=strict)
        else:
            trainer._load_from_checkpoint(path, trainer.model_wrapped if trainer.is_fsdp_enabled else None)
            if not (with_optimizer and trainer.is_fsdp_enabled):
                # The live moments are dropped before the checkpoint's are loaded, not held alongside them (twice the
                # optimizer state at once, on the GPU under DDP); without optimizer state in the checkpoint, fresh
                # moments, as a run resumed from such a checkpoint has. FSDP2's loader reads the live state's layout.
                backend.optimizer.state.clear()
            if with_optimizer:
                trainer._load_optimizer_and_scheduler(path)
        if schedule is not None:
            trainer.lr_scheduler.load_state_dict(schedule)


__all__ = ["load_good_checkpoint"]
