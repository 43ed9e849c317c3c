"""The guard's view of a `transformers.Trainer`: the [`GuardPort`] over it, and the backend the guard binds to."""

from __future__ import annotations

from typing import Any

import torch

from ..guard import Backend, backend_problem, unwrap_optimizer


class TrainerPort:
    """A [`GuardPort`] reading a live trainer: each fact is read when the guard asks (the model and the scheduler
    are replaced while `train()` sets up, the state when a run starts)."""

    def __init__(self, trainer: Any):
        self._trainer = trainer

    @property
    def state(self) -> Any:
        return self._trainer.state

    @property
    def device(self) -> torch.device:
        return self._trainer.args.device

    @property
    def model(self) -> torch.nn.Module:
        return self._trainer.model

    @property
    def scheduler(self) -> Any:
        return self._trainer.lr_scheduler


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
