"""Copies of the model state kept in host memory, and putting them back.

A snapshot holds what a rollback restores: the weights, the optimizer state (moments and step counters) and the
trainer's best-model bookkeeping. It deliberately leaves out what belongs to the run's timeline rather than to the
weights: `global_step`, the data position, the LR schedule position, the loss scaler's calibration, the RNG streams and
the token/FLOP counters keep going (see `recovery.py`). Tensors go to host memory (pinned when a GPU is used, with
non-blocking copies that queue behind the training step on the same stream, so taking a snapshot does not stall the
step). Buffers are allocated once and reused; frozen weights are copied once. Under DeepSpeed ZeRO and FSDP2 each rank
keeps its own shard (for FSDP2, the local shards of its `DTensor` parameters and moments: placements never change, so
taking and restoring a snapshot needs no collective).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from .sharding import like, local, reshard


@dataclass
class Snapshot:
    """The last good training state (see module docstring). `step` is the optimizer step it was taken after."""

    step: int = -1
    epoch: float = 0.0
    counters: dict[str, Any] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    deepspeed_state: Any = None
    ready: Any = None  # a CUDA event recorded after the copies were queued

    @property
    def taken(self) -> bool:
        return self.step >= 0

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


BEST_MODEL_FIELDS = ("best_metric", "best_global_step", "best_model_checkpoint")


class Snapshotter:
    """Takes and restores [`Snapshot`]s of one trainer's state.

    Args:
        model (`torch.nn.Module`): the unwrapped model (`trainer.model`).
        optimizer (`torch.optim.Optimizer`): the torch optimizer (accelerate's wrapper is unwrapped), or the
            DeepSpeed ZeRO optimizer.
        deepspeed_stage (`int | None`): the ZeRO stage when DeepSpeed owns the optimizer, else `None`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any, deepspeed_stage: int | None = None):
        self.model = model
        self.optimizer = optimizer
        self.deepspeed_stage = deepspeed_stage
        self.snapshot = Snapshot()
        self._frozen_done = False

    # -- taking -------------------------------------------------------------------------------------------------
    def take(self, state: Any) -> Snapshot:
        """Copy the current state into the host buffers (asynchronously on GPU) and return the snapshot."""
        snap = self.snapshot
        reshard(self.model)
        if self.deepspeed_stage is not None:
            snap.deepspeed_state = _clone_to_host(
                _deepspeed_state(self.optimizer, self.deepspeed_stage), snap.deepspeed_state
            )
        else:
            for name, param in self.model.named_parameters():
                if param.requires_grad or not self._frozen_done:
                    snap.params[name] = _copy_into(snap.params.get(name), local(param.detach()))
            self._frozen_done = True
            opt = self.optimizer
            index = {id(p): i for i, p in enumerate(_all_params(opt))}
            seen = set()
            for param, pstate in opt.state.items():
                i = index[id(param)]
                seen.add(i)
                slot = snap.optimizer_state.setdefault(i, {})
                for key, value in pstate.items():
                    slot[key] = (
                        _copy_into(slot.get(key), local(value)) if torch.is_tensor(value) else copy.deepcopy(value)
                    )
            for i in list(snap.optimizer_state):
                if i not in seen:
                    del snap.optimizer_state[i]
        snap.counters = {k: getattr(state, k) for k in BEST_MODEL_FIELDS if hasattr(state, k)}
        snap.step = state.global_step
        if torch.cuda.is_available():
            snap.ready = torch.cuda.Event()
            snap.ready.record()
        return snap

    def published(self, path: str) -> None:
        """The trainer published a checkpoint: nothing to do, the host copy is the last good state."""

    def refresh_best_fields(self, state: Any) -> None:
        """Record the best-model fields as they are now, for the weights already in the snapshot."""
        self.snapshot.counters = {k: getattr(state, k) for k in BEST_MODEL_FIELDS if hasattr(state, k)}

    # -- restoring ----------------------------------------------------------------------------------------------
    def restore(self, state: Any) -> Snapshot:
        """Put the last snapshot back into the model, the optimizer state and the best-model bookkeeping.

        The optimizer's hyperparameters (learning rate, betas, ...) stay as they are now: the LR follows the schedule
        position, which a rollback does not rewind.
        """
        snap = self.snapshot
        if not snap.taken:
            raise RuntimeError("No good state to restore: the NaN guard has not taken a snapshot yet.")
        snap.wait()
        reshard(self.model)
        live_groups = [{k: v for k, v in g.items() if k != "params"} for g in _groups(self.optimizer)]
        with torch.no_grad():
            if self.deepspeed_stage is not None:
                _restore_deepspeed(self.optimizer, self.deepspeed_stage, snap.deepspeed_state)
            else:
                for name, param in self.model.named_parameters():
                    if name in snap.params:
                        local(param).copy_(snap.params[name], non_blocking=True)
                params = _all_params(self.optimizer)
                for i, param in enumerate(params):
                    saved = snap.optimizer_state.get(i)
                    if saved is None:
                        self.optimizer.state.pop(param, None)
                        continue
                    live = self.optimizer.state.setdefault(param, {})
                    for key, value in saved.items():
                        current = live.get(key)
                        if torch.is_tensor(value) and torch.is_tensor(current) and local(current).shape == value.shape:
                            local(current).copy_(value, non_blocking=True)
                        elif torch.is_tensor(value):
                            live[key] = like(param, value) if value.dim() > 0 else value.clone()
                        else:
                            live[key] = copy.deepcopy(value)
        for group, live in zip(_groups(self.optimizer), live_groups):
            group.update(live)  # DeepSpeed's `load_state_dict` brings the snapshot's hyperparameters back
        for key, value in snap.counters.items():
            setattr(state, key, value)
        return snap


def scale_learning_rate(optimizer: Any, scheduler: Any, factor: float) -> float:
    """Multiply the current and scheduled learning rates by `factor`; return the new learning rate of group 0."""
    for group in _groups(optimizer):
        group["lr"] = group["lr"] * factor
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps the torch one
    if inner is not None and hasattr(inner, "base_lrs"):
        inner.base_lrs = [lr * factor for lr in inner.base_lrs]
        if hasattr(inner, "_last_lr"):
            inner._last_lr = [g["lr"] for g in _groups(optimizer)]
    groups = _groups(optimizer)
    return groups[0]["lr"] if groups else float("nan")


def _groups(optimizer: Any) -> list[dict]:
    return list(getattr(optimizer, "param_groups", []))


def _all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _copy_into(buffer: torch.Tensor | None, source: torch.Tensor) -> torch.Tensor:
    """Copy `source` into a reusable host buffer (allocated, pinned on GPU machines, on first use)."""
    if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
        buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=source.is_cuda)
    buffer.copy_(source, non_blocking=source.is_cuda)
    return buffer


def _clone_to_host(value: Any, previous: Any = None) -> Any:
    """A host copy of a nested structure of tensors, reusing the buffers of `previous` where shapes match."""
    if torch.is_tensor(value):
        return _copy_into(previous if torch.is_tensor(previous) else None, value.detach())
    if isinstance(value, dict):
        prev = previous if isinstance(previous, dict) else {}
        return {k: _clone_to_host(v, prev.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        prev = previous if isinstance(previous, (list, tuple)) and len(previous) == len(value) else [None] * len(value)
        return type(value)(_clone_to_host(v, p) for v, p in zip(value, prev))
    return copy.deepcopy(value)


def _deepspeed_state(optimizer: Any, stage: int) -> dict[str, Any]:
    """This rank's shard of the ZeRO optimizer: the fp32 master partitions and the base optimizer's state."""
    if stage == 3:
        # Read only: no `checkpoint_event_prologue` here, which would release the gathered parameters mid-step and
        # break ZeRO-3's prefetch trace.
        return optimizer.state_dict()
    return {
        "base": optimizer.optimizer.state_dict(),
        "fp32": list(optimizer.single_partition_of_fp32_groups),
    }


def _restore_deepspeed(optimizer: Any, stage: int, saved: dict[str, Any]) -> None:
    if stage == 3:
        # The sequence of DeepSpeed's own checkpoint load: restores the base optimizer state, the fp32 partitions,
        # the 16-bit partitions from them, and re-gathers the persistent (unpartitioned) parameters. The list is
        # indexed by data-parallel rank, and each rank only reads its own entry: this rank's snapshot.
        optimizer.checkpoint_event_prologue()
        optimizer.load_state_dict([saved] * torch.distributed.get_world_size(), load_optimizer_states=True)
        optimizer.checkpoint_event_epilogue()
        return
    optimizer.optimizer.load_state_dict(saved["base"])
    for live, host in zip(optimizer.single_partition_of_fp32_groups, saved["fp32"]):
        live.data.copy_(host)
    # fp32 partition -> this rank's 16-bit partition -> all-gathered into every rank's 16-bit weights.
    optimizer.update_lp_params()
