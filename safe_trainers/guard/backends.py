"""The distributed backends the NaN guard protects: single process, DDP, DeepSpeed ZeRO 1-3, and FSDP2.

A backend the guard cannot protect is refused when the trainer is built, never left to train silently unprotected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..runtime.finite import deepspeed_state_tensors, optimizer_tensors
from ..runtime.sharding import local
from .step.skip import unwrap_optimizer

FSDP1_REFUSED = (
    "`nan_guard=True` protects FSDP version 2 (`fully_shard`), got FSDP version 1. Use FSDP2, TRL's recommended "
    "multi-GPU setup: `fsdp_config={'version': 2}` (or `fsdp_version: 2` in the accelerate config, e.g. "
    "`configs/accelerate/fsdp2.yaml`), or set `nan_guard=False` to train without the guard."
)
ZERO0_REFUSED = (
    "`nan_guard=True` supports DeepSpeed ZeRO stages 1, 2 and 3, got stage 0. Use ZeRO, or plain DDP, or set "
    "`nan_guard=False`."
)


@dataclass(frozen=True)
class Backend:
    """What the guard binds to when training starts.

    Args:
        optimizer: the torch optimizer (accelerate's wrapper unwrapped), or DeepSpeed's ZeRO optimizer.
        zero_stage (`int | None`): the ZeRO stage when DeepSpeed owns the optimizer, else `None`.
        loss_scaled (`bool`): an fp16 loss scaler is active (its overflows are not faults).
        scaler: accelerate's `GradScaler` when one drives the optimizer step (fp16 without DeepSpeed), else `None`.
    """

    optimizer: Any
    zero_stage: int | None
    loss_scaled: bool
    scaler: Any = None


def backend_problem(fsdp_version: int | None = None, zero_stage: int | None = None) -> str | None:
    """Why the guard cannot protect this backend, or `None` when it can. `fsdp_version`: the FSDP plugin's version,
    `None` without FSDP; `zero_stage`: DeepSpeed's ZeRO stage, `None` without DeepSpeed.

    FSDP version 1 flattens parameters into per-rank `FlatParameter`s that the guard does not snapshot; FSDP2
    (`fully_shard`, DTensor parameters) is supported. DeepSpeed without ZeRO has no partitioned state to snapshot.
    """
    if fsdp_version == 1:
        return FSDP1_REFUSED
    if zero_stage == 0:
        return ZERO0_REFUSED
    return None


def state_tensors(backend: Backend | None, model: Any) -> list[Any]:
    """What the guard checks: the weights and optimizer state of `model` trained by `backend` (DeepSpeed's ZeRO
    partitions, which hold both, under DeepSpeed; `None`: not bound yet, the weights alone)."""
    if backend is not None and backend.zero_stage is not None:
        return deepspeed_state_tensors(backend.optimizer, backend.zero_stage)
    optimizer = backend.optimizer if backend is not None else None
    return list(model.parameters()) + (optimizer_tensors(optimizer) if optimizer is not None else [])


def state_bytes(backend: Backend | None, model: Any) -> int:
    """The bytes of [`state_tensors`] this rank holds (a sharded tensor's local shard)."""
    return sum(local(t).numel() * local(t).element_size() for t in state_tensors(backend, model))


__all__ = ["Backend", "backend_problem", "state_bytes", "state_tensors", "unwrap_optimizer"]
