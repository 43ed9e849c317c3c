"""Checkpoint safety: checks that a state is finite, and the staging directory for write-then-rename saves."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable

import torch

from .sharding import local

STAGING_DIR = ".safe_trainers_staging"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def all_finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor on the tensors' device: whether every floating tensor is finite (no host sync).

    Uses one fused norm per device: the norm of a tensor with a NaN or Inf is non-finite. Sharded tensors (FSDP2's
    `DTensor`) are checked on this rank's shard, with no collective.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        t = local(t) if t is not None else None
        if t is not None and t.is_floating_point() and t.numel() > 0:
            by_device.setdefault(t.device, []).append(t.detach())
    flags = []
    for group in by_device.values():
        norms = torch._foreach_norm([t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in group])
        flags.append(torch.isfinite(torch.stack(norms)).all())
    if not flags:
        return torch.tensor(True)
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


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


def staging_run_dir(run_dir: str) -> str:
    return os.path.join(run_dir, STAGING_DIR)


def publish(staged: str, final: str) -> None:
    """Move a fully written checkpoint from the staging directory to its final name (atomic on one filesystem)."""
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(staged, final)
    staging = os.path.dirname(staged)
    if not os.listdir(staging):
        os.rmdir(staging)


def clean_staging(run_dir: str) -> list[str]:
    """Remove half-written checkpoints left by a crash during saving; return what was removed."""
    staging = staging_run_dir(run_dir)
    if not os.path.isdir(staging):
        return []
    removed = [os.path.join(staging, name) for name in os.listdir(staging)]
    shutil.rmtree(staging, ignore_errors=True)
    return removed


def checkpoint_step(path: str) -> int | None:
    """The step of a `checkpoint-N` directory (`None` for any other name)."""
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def checkpoints(run_dir: str) -> list[str]:
    """The published `checkpoint-N` directories of `run_dir`, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(run_dir) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(run_dir, name) for _, name in sorted(found)]
