"""Copies of the model state kept in host memory, and putting them back.

A snapshot holds what a rollback restores, which is what the optimizer can change: the trainable parameters, the
optimizer state (moments and step counters) and the trainer's best-model bookkeeping. Frozen parameters (a LoRA base)
are checked like the rest but never copied: if one is ever found damaged, a restore repairs it from its files or
stops the run (`frozen.py`). A snapshot deliberately leaves out what belongs to the run's timeline rather than to the
weights: `global_step`, the data position, the LR schedule position, the loss scaler's calibration, the RNG streams and
the token/FLOP counters keep going (see `rollback/actions.py`).

Tensors go to host memory: one buffer per dtype, sized exactly and reused from one snapshot to the next, each tensor a
view of it (`runtime/host_buffers.py`); page-locked when a GPU is used, with non-blocking copies on a side stream that
overlap the next steps' forward and backward (`runtime/copy_stream.py`): the first later write of the state (the
optimizer step, through [`HostSnapshot.before_write`]) waits for them on the device, and a restore waits for them on
the host. Under DeepSpeed ZeRO they queue behind the step on the training stream. A restore copies each tensor back
into the live tensor it replaces, on that tensor's device and in its dtype, so neither needs more than the tensor
itself. Under DeepSpeed ZeRO and FSDP2 each rank keeps its own shard (for FSDP2, the local shards of its `DTensor`
parameters and moments: placements never change, so taking and restoring a snapshot needs no collective). Under
DDP, whose ranks hold identical replicas, each rank keeps 1/N of one copy and a restore broadcasts the pieces back
(`replica_shards.py`; the snapshot's `params` and `optimizer_state` are then empty).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...runtime.copy_stream import CopyStream
from ...runtime.host_buffers import HostBuffers, copy_to_host
from ...runtime.sharding import is_sharded, like, local, reshard
from ..backends import Backend
from .checkpoint import CheckpointSource
from .frozen import repair_frozen
from .replica_shards import replica_shards, shard_fallback
from .source import Snapshot, best_model_fields, kept_hyperparameters


class HostSnapshot:
    """Takes and restores [`Snapshot`]s of one trainer's state in host memory (a [`RollbackSource`]).

    Args:
        model (`torch.nn.Module`): the unwrapped model (`trainer.model`).
        backend ([`Backend`]): what the guard bound to: the torch optimizer (accelerate's wrapper unwrapped) or the
            DeepSpeed ZeRO optimizer, and the ZeRO stage.
        resumed_from (`str | None`): the checkpoint `train()` resumed from, if any: with the checkpoints this run
            publishes, where a damaged frozen parameter may be restored from.
        events ([`EventLog`], *optional*): the run's event log, and `output_dir` (`str`, *optional*) where the run
            publishes: under DDP, where a rollback that finds a rank without its shard says so and looks for the
            checkpoint it loads instead (`replica_shards.py`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: Backend,
        resumed_from: str | None = None,
        events: Any = None,
        output_dir: str | None = None,
    ):
        self.model = model
        self.backend = backend
        self.optimizer, self.deepspeed_stage = backend.optimizer, backend.zero_stage
        self.snapshot = Snapshot()
        self.host = HostBuffers()  # the weights (under DeepSpeed or DDP shards, the whole state)
        self.moments = HostBuffers()  # the optimizer's state, apart: see [`take`]
        self.copies = CopyStream()
        self.checkpoints: list[str] = [resumed_from] if resumed_from else []
        self.events, self.output_dir = events, output_dir
        self.replicas = replica_shards(model, backend)  # DDP: this rank keeps 1/N of the snapshot
        self.may_load = self.replicas is not None  # a DDP rank without its shard loads the newest checkpoint
        self.fallback: CheckpointSource | None = None  # a DDP rank lost its shard: the rollback loads from disk
        self.allocated = 0.0  # the seconds the last take spent allocating its host buffers

    # -- taking -------------------------------------------------------------------------------------------------
    def take(self, state: Any) -> Snapshot:
        """Copy the current state into the host buffers (asynchronously on GPU) and return the snapshot."""
        snap, buffers = self.snapshot, (self.host, self.moments)
        allocations = [b.allocations for b in buffers]
        reshard(self.model)
        # Drop the previous copy's views first: when the layout changes (the optimizer's moments appear after its
        # first step) its buffers are then freed before the new ones are allocated, not held alongside them.
        snap.step, snap.params, snap.optimizer_state, snap.deepspeed_state = -1, {}, {}, None
        if self.deepspeed_stage is not None:
            source = _deepspeed_state(self.optimizer, self.deepspeed_stage)
            snap.placements = _placements(source["base"]) if self.deepspeed_stage != 3 else {}
            snap.deepspeed_state, snap.ready = self.copies.copy(source, self.host, self.deepspeed_stage)
        else:
            live = {
                "params": {n: p for n, p in self.model.named_parameters() if p.requires_grad},
                "optimizer": _optimizer_state(self.optimizer),
            }
            snap.placements = _placements(live["optimizer"])
            if self.replicas is not None:
                step = state.global_step
                _, snap.ready = self.copies.run(live, lambda stream: self.replicas.take(live, self.host, step, stream))
            else:
                held, snap.ready = self.copies.run(live, lambda stream: self._copy_apart(live, stream))
                snap.params, snap.optimizer_state = held["params"], held["optimizer"]
        snap.counters = best_model_fields(state)
        snap.step = state.global_step
        self.allocated = sum(b.allocation_seconds for b, n in zip(buffers, allocations) if b.allocations != n)
        return snap

    def _copy_apart(self, live: dict[str, Any], stream: Any) -> dict[str, Any]:
        """The weights and the optimizer state, each into buffers of its own: the moments, which appear at the
        optimizer's first step (after the first snapshot), then allocate only their own buffers while the weights'
        are kept (one buffer for both would be allocated anew, the weights' share included: docs/guard.md, "The
        cost as runs grow")."""
        return {
            "params": copy_to_host(live["params"], self.host, stream=stream),
            "optimizer": copy_to_host(live["optimizer"], self.moments, stream=stream),
        }

    def held_bytes(self) -> int:
        """The host bytes the snapshot's buffers hold (this rank's share under DDP)."""
        return self.host.nbytes() + self.moments.nbytes()

    def before_write(self) -> None:
        """The weights or the optimizer state are about to be written: the copies of the last snapshot, if still in
        flight, finish first (the training stream waits on the device, [`CopyStream.before_write`])."""
        self.copies.before_write()

    def copy_delay_seconds(self) -> float | None:
        """How long the training stream was held up by the copies of the last snapshot whose copies completed
        ([`CopyStream.delay_seconds`]: the wait at the first write after it, or the copies' own time when they ran on
        the training stream); `0.0` for host copies, `None` before it is known. Never synchronises."""
        return self.copies.delay_seconds()

    def allocation_seconds(self) -> float:
        """The host seconds the last [`take`] spent allocating its host buffers (a new layout: the first snapshot, and
        the first with the optimizer's moments), page-locking them on a GPU: a one-time cost, not a copy's (the
        snapshot interval leaves it out); `0.0` when it reused them."""
        return self.allocated

    def published(self, path: str) -> None:
        """The trainer published a verified checkpoint: a source for damaged frozen parameters (the host copy stays
        the last good state)."""
        self.checkpoints.append(path)

    def needs_checkpoint(self, step: int) -> bool:
        """Never: the host copy is the good state."""
        return False

    def to_load(self, step: int) -> str | None:
        """Nothing for the caller to load: [`restore`] copies the host snapshot back; unless it is sharded over DDP
        ranks and one lost its shard: then the newest verified checkpoint ([`shard_fallback`], a collective; with
        none, the run stops, as a disk rollback with no good state does)."""
        self.fallback = shard_fallback(self, step) if self.replicas is not None else None
        return self.fallback.to_load(step) if self.fallback is not None else None

    def refresh_best_fields(self, state: Any) -> None:
        """Record the best-model fields as they are now, for the weights already in the snapshot."""
        self.snapshot.counters = best_model_fields(state)

    # -- restoring ----------------------------------------------------------------------------------------------
    def restore(self, state: Any) -> Snapshot:
        """Put the last snapshot back into the model, the optimizer state and the best-model bookkeeping.

        The optimizer's hyperparameters (learning rate, betas, ...) stay as they are now: the LR follows the schedule
        position, which a rollback does not rewind. A parameter the snapshot does not hold (frozen when it was taken)
        found non-finite is restored from its files, or the run stops ([`repair_frozen`]).
        """
        if self.fallback is not None:  # the caller loaded the checkpoint `to_load` named
            source, self.fallback = self.fallback, None
            return source.restore(state)
        snap = self.snapshot
        if not snap.taken:
            raise RuntimeError("No good state to restore: the NaN guard has not taken a snapshot yet.")
        snap.wait()
        reshard(self.model)
        # DeepSpeed's `load_state_dict` would bring the snapshot's hyperparameters back: the live ones are kept.
        with torch.no_grad(), kept_hyperparameters(self.optimizer):
            if self.deepspeed_stage is not None:
                _restore_deepspeed(self.optimizer, self.deepspeed_stage, snap.deepspeed_state, snap.placements)
            elif self.replicas is not None:
                self.replicas.restore(self.model, self.optimizer)
            else:
                for name, param in self.model.named_parameters():
                    if name in snap.params:
                        local(param).copy_(snap.params[name], non_blocking=True)
                _restore_optimizer_state(self.optimizer, snap.optimizer_state, snap.placements)
        for key, value in snap.counters.items():
            setattr(state, key, value)
        held = self.replicas.names if self.replicas is not None else snap.params
        repair_frozen(self.model, self.checkpoints, state.global_step, held=held)
        return snap


def _all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _optimizer_state(optimizer: Any) -> dict[int, dict[str, Any]]:
    """The optimizer's per-parameter state (live tensors), keyed by the parameter's index in its param groups."""
    index = {id(p): i for i, p in enumerate(_all_params(optimizer))}
    return {index[id(p)]: dict(pstate) for p, pstate in optimizer.state.items() if id(p) in index}


def _placements(state: dict[int, dict[str, Any]]) -> dict[tuple[int, str], tuple[torch.device, bool]]:
    return {
        (i, key): (local(v).device, is_sharded(v))
        for i, slot in state.items()
        for key, v in slot.items()
        if torch.is_tensor(v)
    }


def _restore_optimizer_state(optimizer: Any, saved: dict[int, dict[str, Any]], placements: dict) -> None:
    """Put a snapshot's optimizer state back: each tensor copied into the live one it replaces (same device, same
    dtype, no new memory), or recreated where it was copied from when there is none."""
    for i, param in enumerate(_all_params(optimizer)):
        slot = saved.get(i)
        if slot is None:
            optimizer.state.pop(param, None)
            continue
        live = optimizer.state.setdefault(param, {})
        for key, value in slot.items():
            live[key] = _restored(live.get(key), value, param, placements.get((i, key)))


def _restored(current: Any, value: Any, param: torch.Tensor, placement: tuple[torch.device, bool] | None) -> Any:
    """The live value after restoring `value` (a host copy) over `current`."""
    if not torch.is_tensor(value):
        return copy.deepcopy(value)
    if torch.is_tensor(current) and local(current).shape == value.shape:
        local(current).copy_(value, non_blocking=True)
        return current
    device, sharded = placement or (local(param).device, is_sharded(param) and value.dim() > 0)
    if sharded:
        return like(param, value)
    # A copy, never the host view itself (the next snapshot overwrites it), on the device it came from: AdamW's
    # 0-dim `step` lives on the GPU under the fused and capturable implementations, on the CPU otherwise.
    return value.to(device, copy=True)


def _deepspeed_state(optimizer: Any, stage: int) -> dict[str, Any]:
    """This rank's shard of the ZeRO optimizer: the fp32 master partitions and the base optimizer's state (live
    tensors, copied by the caller)."""
    if stage == 3:
        # Read only: no `checkpoint_event_prologue` here, which would release the gathered parameters mid-step and
        # break ZeRO-3's prefetch trace.
        return optimizer.state_dict()
    return {
        "base": _optimizer_state(optimizer.optimizer),
        "fp32": list(optimizer.single_partition_of_fp32_groups),
    }


def _restore_deepspeed(optimizer: Any, stage: int, saved: dict[str, Any], placements: dict) -> None:
    if stage == 3:
        # The sequence of DeepSpeed's own checkpoint load: restores the base optimizer state, the fp32 partitions,
        # the 16-bit partitions from them, and re-gathers the persistent (unpartitioned) parameters. The list is
        # indexed by data-parallel rank, and each rank only reads its own entry: this rank's snapshot.
        optimizer.checkpoint_event_prologue()
        optimizer.load_state_dict([saved] * torch.distributed.get_world_size(), load_optimizer_states=True)
        optimizer.checkpoint_event_epilogue()
        return
    # ZeRO-1/2: the base optimizer's state and the fp32 partitions (its parameters), copied into the live tensors.
    _restore_optimizer_state(optimizer.optimizer, saved["base"], placements)
    for live, host in zip(optimizer.single_partition_of_fp32_groups, saved["fp32"]):
        live.data.copy_(host, non_blocking=True)
    # fp32 partition -> this rank's 16-bit partition -> all-gathered into every rank's 16-bit weights.
    optimizer.update_lp_params()
