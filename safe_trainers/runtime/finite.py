"""Whether a state is finite: the bounded, fused check of the weights and optimizer state (the inspection's hot
path)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .nested import tensors as nested_tensors
from .sharding import local

# The most bytes a pass over the state holds beyond its inputs, per piece: a check reads every tensor in flat pieces
# of at most this many bytes (whatever the tensor's dtype, in elements of at least 4 bytes), so that no precision or
# contiguous copy of a whole tensor, let alone of the model, is ever made.
CHUNK_BYTES = 64 * 2**20
# Pieces reduced together (one fused launch on CUDA) and folded into the running flag: few pending, whatever the model.
_BATCH = 256


def flat_chunks(tensor: torch.Tensor, elements: int | None = None) -> Iterator[torch.Tensor]:
    """`tensor` as views of at most `elements` elements each (by default `CHUNK_BYTES` worth, counting at least 4
    bytes an element), covering every element once. Contiguous tensors are split flat; others along their leading
    dimensions, so each piece is a view and a reduction over it never copies more than one piece. Two tensors of the
    same shape and strides are split alike."""
    n = elements or CHUNK_BYTES // max(tensor.element_size(), 4)
    if tensor.is_contiguous():
        yield from tensor.reshape(-1).split(n)
    elif tensor.numel() <= n:
        yield tensor
    elif tensor.shape[0] == 1:
        yield from flat_chunks(tensor[0], n)
    else:
        rows = max(n // max(tensor[0].numel(), 1), 1)
        for slab in tensor.split(rows):
            yield from flat_chunks(slab, n)


def all_finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor on the tensors' device: whether every floating tensor is finite (no host sync).

    Reads each tensor in pieces of at most `CHUNK_BYTES` ([`flat_chunks`]), reduces each piece to its extreme values
    and folds their finiteness into one running flag per device: no copy of a whole tensor, whatever the model's size
    or dtype, and no sum or L2 norm, which large finite values could overflow into a false alarm. The reduction is
    the fastest measured that propagates NaN ([`EXTREMES`]). One-byte float types (float8) are read a piece at a time
    in bfloat16, which holds each of their values. Sharded tensors (FSDP2's `DTensor`) are checked on this rank's
    shard, with no collective.
    """
    flags: dict[torch.device, torch.Tensor] = {}
    pending: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        t = local(t) if t is not None else None
        if t is None or not t.is_floating_point() or t.numel() == 0:
            continue
        for piece in flat_chunks(t.detach()):
            if piece.element_size() == 1:  # a bfloat16 copy of one piece, reduced right away
                _fold(flags, [piece.to(torch.bfloat16)])
                continue
            bucket = pending.setdefault((piece.device, piece.dtype), [])
            bucket.append(piece)
            if len(bucket) >= _BATCH:
                _fold(flags, bucket)
    for bucket in pending.values():
        _fold(flags, bucket)
    if not flags:
        return torch.tensor(True)
    values = list(flags.values())
    return torch.stack([f.to(values[0].device) for f in values]).all()


def any_nonfinite(value: Any) -> bool:
    """Whether a tensor, or any floating tensor of a nested structure of them, holds a NaN or Inf (a host sync; read
    in bounded pieces by [`all_finite`], with no copy of a whole tensor)."""
    return not bool(all_finite(nested_tensors(value)))


def _max_magnitudes(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The largest magnitude of each piece (NaN if it holds one), in one fused launch."""
    return list(torch._foreach_norm(pieces, ord=float("inf")))


def _extremes(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The smallest and largest value of each piece (NaN if it holds one)."""
    return [value for piece in pieces for value in torch.aminmax(piece)]


# The reduction per device type, the fastest measured (bench/guard_memory.py's notes): on CUDA the fused max-norm
# (4-7x faster than one `aminmax` per piece over 1,000-2,000 tensors on an H100), elsewhere `aminmax` (on the CPU
# about 30x faster than `_foreach_norm`, which falls back to one norm per tensor there).
EXTREMES: dict[str, Callable[[list[torch.Tensor]], list[torch.Tensor]]] = {"cuda": _max_magnitudes}


def _fold(flags: dict[torch.device, torch.Tensor], bucket: list[torch.Tensor]) -> None:
    """Fold the finiteness of `bucket`'s pieces (one device and dtype) into the device's running flag."""
    if not bucket:
        return
    device = bucket[0].device
    finite = torch.isfinite(torch.stack(EXTREMES.get(device.type, _extremes)(bucket))).all()
    flags[device] = finite if device not in flags else flags[device] & finite
    bucket.clear()


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor of a torch optimizer's state (moments, step counters)."""
    out = []
    for state in getattr(optimizer, "state", {}).values():
        out.extend(v for v in state.values() if torch.is_tensor(v))
    return out


def deepspeed_state_tensors(optimizer, stage: int) -> list[torch.Tensor]:
    """This rank's share of a DeepSpeed ZeRO optimizer's state: fp32 master and 16-bit partitions, moments."""
    if stage == 3:
        tensors = list(optimizer.fp32_partitioned_groups_flat) + list(optimizer.fp16_partitioned_groups_flat)
        tensors += [p.data for p in getattr(optimizer, "persistent_parameters", [])]
    else:
        tensors = list(optimizer.single_partition_of_fp32_groups) + list(optimizer.bit16_groups_flat)
    return tensors + optimizer_tensors(optimizer.optimizer)
