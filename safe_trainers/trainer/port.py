"""The guard's view of a `transformers.Trainer`: the [`GuardPort`] over it, and the backend the guard binds to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..guard import Backend, backend_problem, unwrap_optimizer


@dataclass
class TrainerPort:
    """A [`GuardPort`] over a trainer: the facts the guard reads, as plain values, bound when training starts
    ([`bind`], at `on_train_begin`: the Trainer makes its state, wraps the model and makes the scheduler inside
    `train()`), so the guard's reads on the per-step path are attribute reads, not calls."""

    state: Any = None
    device: torch.device | None = None
    model: torch.nn.Module | None = None
    scheduler: Any = None

    def bind(self, trainer: Any) -> None:
        """Read the facts of the `train()` call that starts."""
        self.state, self.device = trainer.state, trainer.args.device
        self.model, self.scheduler = trainer.model, trainer.lr_scheduler


def training_backend(trainer: Any) -> Backend:
    """The optimizer, ZeRO stage and loss scaling of a trainer whose training has started (DeepSpeed's engine exists
    then); raises a `ValueError` for a backend the guard cannot protect."""
    if trainer.is_deepspeed_enabled:
        stage = trainer.accelerator.state.deepspeed_plugin.zero_stage
        problem = backend_problem(zero_stage=stage)
        if problem is not None:
            raise ValueError(problem)
        engine = trainer.model_wrapped
        return Backend(engine.optimizer, stage, bool(engine.fp16_enabled()))
    optimizer = unwrap_optimizer(trainer.optimizer)
    scaler = trainer.accelerator.scaler
    return Backend(optimizer, None, scaler is not None and scaler.is_enabled(), scaler)


def refuse_unsupported_backend(trainer: Any) -> None:
    """Raise a `ValueError` when [`backend_problem`] finds one for the built trainer."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    problem = backend_problem(fsdp_version=getattr(plugin, "fsdp_version", 2) if plugin is not None else None)
    if problem is not None:
        raise ValueError(problem)


__all__ = ["TrainerPort", "refuse_unsupported_backend", "training_backend"]
