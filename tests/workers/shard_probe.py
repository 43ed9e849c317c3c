"""A callback for the sharded-snapshot tests (tests/guard/test_replica_shards_distributed.py): after each step's
callbacks (the guard's snapshot and rollback included), a digest of this rank's weights and optimizer state, and the
host bytes the guard's snapshot holds; optionally, this rank's shard of the snapshot dropped after one step, as a
process that replaced this one would have none (`ReplicaShards.drop`)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from transformers import TrainerCallback


def digest(tensors: list[torch.Tensor]) -> str:
    """A hash of the tensors' exact bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def state_tensors(model: torch.nn.Module, optimizer: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The trainable weights (in `named_parameters` order) and the optimizer state's tensors (by parameter, key)."""
    weights = [p for _, p in model.named_parameters() if p.requires_grad]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    moments = [
        value
        for p in params
        for _, value in sorted(optimizer.state.get(p, {}).items())
        if torch.is_tensor(value)
    ]
    return weights, moments


class ShardProbe(TrainerCallback):
    """Records `digests[step] = {"weights": ..., "optimizer": ...}`, the most host bytes the snapshot held
    (`host_bytes`) and the state's bytes then (`state_bytes`: what one unsharded snapshot copies); drops this rank's
    shard after the step `drop_step` when this is rank `drop_rank`."""

    def __init__(self, trainer: Any, drop_step: int | None = None, drop_rank: int | None = None):
        self.trainer, self.drop_step, self.drop_rank = trainer, drop_step, drop_rank
        self.digests: dict[int, dict[str, str]] = {}
        self.host_bytes = self.state_bytes = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.on_step_end(args, state, control)  # step 0: the state the guard's first snapshot holds

    def on_step_end(self, args, state, control, **kwargs):
        snapshotter = self.trainer.nan_guard.snapshotter
        weights, moments = state_tensors(self.trainer.model, snapshotter.optimizer)
        self.digests[state.global_step] = {"weights": digest(weights), "optimizer": digest(moments)}
        held = snapshotter.held_bytes()
        if held >= self.host_bytes:
            self.host_bytes = held
            self.state_bytes = sum(t.numel() * t.element_size() for t in weights + moments)
        if (state.global_step, args.process_index) == (self.drop_step, self.drop_rank):
            snapshotter.replicas.drop()
