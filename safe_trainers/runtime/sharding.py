"""What the NaN guard needs from sharded tensors (FSDP2's DTensor parameters, gradients and optimizer state).

Under FSDP2 (`fully_shard`) every parameter, gradient and Adam moment is a `DTensor` whose local shard lives on its
rank. The guard works on the local shards only: checking them for NaN/Inf, copying them to host memory and back
needs no collective, because a snapshot and its restore keep each shard on the rank that owns it (placements never
change). The one value the guard needs whole is the gradient norm, which FSDP2 returns as a `DTensor`.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support
    DTensor = None


def is_sharded(tensor: Any) -> bool:
    """Whether `tensor` is a `DTensor` (a parameter, gradient or optimizer state of an FSDP2 model)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a `DTensor` (sharing its storage: an in-place write changes the parameter), or the
    tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def replicated(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a `DTensor` as a plain tensor on every rank (a collective when it is a partial sum, no host
    synchronisation), or the tensor itself. For one-element values such as the gradient norm."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def like(template: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """`shard` (host or device) as a tensor placed like `template`: a `DTensor` with the template's mesh and
    placements (this rank's shard, no collective) when `template` is one, else a copy on the template's device."""
    if is_sharded(template):
        value = shard.to(template.to_local().device, copy=True)
        return DTensor.from_local(value, template.device_mesh, template.placements, run_check=False)
    return shard.to(template.device, copy=True)


def reshard(model: torch.nn.Module) -> None:
    """Put an FSDP2 model's parameters back in their sharded form (a no-op for any other model, or when they are).

    A forward pass outside training (the guard's diagnosis replay, an evaluation) can leave the root module's
    parameters gathered, and `named_parameters()` then yields the whole, unsharded tensors. The snapshot and its
    restore work on the shards, so the guard reshards first.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


__all__ = ["is_sharded", "like", "local", "replicated", "reshard"]
