"""The few collectives the NaN guard needs, all no-ops in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def ranks_with_flag(local: torch.Tensor) -> list[list[int]]:
    """For each step, the ranks whose local loss flag is set (all ranks take part: a collective)."""
    if not distributed():
        return [[0] if flag else [] for flag in local.cpu().tolist()]
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local.contiguous())
    table = torch.stack(gathered).cpu().tolist()  # [rank][step]
    return [[rank for rank, flags in enumerate(table) if flags[i]] for i in range(local.shape[0])]


def max_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of the float tensor `values` over ranks, on the device (one all-reduce; no host
    synchronisation; `values` itself in a single process). Flags ride on it as 0/1 (a maximum is their OR). A NaN
    does not propagate through MAX on every backend (gloo keeps a finite value from another rank when the NaN is on
    rank 0: `tests/guard/test_collectives.py`): fold non-finite values into flags before calling."""
    if not distributed():
        return values
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """The element-wise mean of `value` over ranks (an all-reduce; `value` itself in a single process)."""
    if not distributed():
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()


def gathered(values: torch.Tensor) -> torch.Tensor:
    """Every rank's `values`, stacked in rank order (an all-gather; `values[None]` in a single process)."""
    if not distributed():
        return values[None]
    parts = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, values.contiguous())
    return torch.stack(parts)
