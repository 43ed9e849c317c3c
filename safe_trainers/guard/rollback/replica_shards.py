"""The host snapshot sharded across data-parallel replicas: under DDP each rank keeps 1/N of it.

Under plain data parallelism (DDP through `accelerate launch --multi_gpu` or `torchrun`, world size N > 1; not
DeepSpeed ZeRO nor FSDP2, whose ranks hold their own shards already, `memory.py`) every rank's weights and optimizer
state are identical by construction, so one copy in host memory is enough for all of them. The replicated tensors
(the trainable parameters, then the optimizer state's tensors) are laid out as one flat sequence of bytes, in the same
order on every rank; rank `r` owns the bytes from `r * S / N` to `(r + 1) * S / N` (S their total), cut into pieces of
at most [`PIECE_BYTES`], each a contiguous element range of one tensor, so a large embedding is split too
([`shard_layout`], a pure function of the shapes and dtypes, identical on every rank). A snapshot copies only this
rank's pieces to its host buffers; 0-dim tensors (AdamW's step counters) stay whole on every rank.

A restore puts the whole state back on every rank, piece by piece: the owner copies its host piece into the live
tensor's element range, then broadcasts that same range (a view of the live tensor: no staging buffer) to every
rank. No rank ever holds more than its own state plus its shard. Before it, one small collective checks that every
rank still holds its shard of the same snapshot ([`ReplicaShards.missing`]); when one does not (a restart replaced
the process, the snapshots' steps disagree), the rollback loads the newest verified checkpoint instead, as
`nan_rollback_from="checkpoint"` does, with a warning and a `shard_missing` event (`memory.py`, `to_load`).
"""

from __future__ import annotations

import contextlib

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...runtime.collectives import distributed, gathered
from ...runtime.events import RunEvent
from ...runtime.host_buffers import HostBuffers, queue_host_copy
from ...runtime.sharding import is_sharded
from ..backends import Backend
from .checkpoint import CheckpointSource
from .source import param_groups

logger = logging.getLogger("safe_trainers")

# The largest piece of a tensor copied or broadcast at once (a restore holds at most one piece beyond the state).
PIECE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Piece:
    """Elements `start` to `stop` (exclusive) of the flattened tensor number `tensor`, kept by rank `owner`."""

    tensor: int
    start: int
    stop: int
    owner: int


def shard_layout(sizes: Sequence[tuple[int, int]], world_size: int, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """Cut tensors laid out back to back into pieces and give each to a rank (pure: same input, same layout).

    Args:
        sizes (`Sequence[tuple[int, int]]`): each tensor's `(numel, element_size)`, in the order shared by all ranks.
        world_size (`int`): the number of ranks.
        piece_bytes (`int`): the most bytes of a piece (a piece holds at least one element).

    Returns:
        The pieces in the order of the flat sequence. Rank `r` owns the elements whose first byte lies in
        `[r * S / N, (r + 1) * S / N)`, so it holds at most `S / N` bytes plus one element; every element is in
        exactly one piece, and a piece is at most `piece_bytes` (or one element) long.
    """
    if world_size < 1 or piece_bytes < 1:
        raise ValueError(f"`world_size` and `piece_bytes` must be positive, got {world_size} and {piece_bytes}.")
    total = sum(numel * size for numel, size in sizes)
    pieces: list[Piece] = []
    offset = 0  # the byte where the current tensor starts
    for index, (numel, size) in enumerate(sizes):
        start = 0
        while start < numel:
            owner = min((offset + start * size) * world_size // total, world_size - 1)
            range_end = -(-(owner + 1) * total // world_size)  # the first byte past the owner's range
            stop = min(numel, -(-(range_end - offset) // size), start + max(1, piece_bytes // size))
            pieces.append(Piece(index, start, stop, owner))
            start = stop
        offset += numel * size
    return pieces


@dataclass(frozen=True)
class TensorSpec:
    """What a restore needs to find or recreate one live tensor: its shape, dtype and device, for a 0-dim tensor
    (kept whole on every rank) its host copy (`None` for a sharded tensor, whose values come with the pieces), and for
    a sharded one its strides (its pieces follow its memory order, [`_flat`])."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    value: torch.Tensor | None = None
    stride: tuple[int, ...] | None = None


def replica_shards(model: torch.nn.Module, backend: Backend) -> ReplicaShards | None:
    """A [`ReplicaShards`] when the run is plain data parallel over several ranks, else `None` (one process, or a
    backend whose ranks keep their own shards: DeepSpeed ZeRO, FSDP2)."""
    if backend.zero_stage is not None or not distributed():
        return None
    params = list(model.parameters())
    if any(is_sharded(p) for p in params):
        return None
    device = params[0].device if params else torch.device("cpu")
    return ReplicaShards(dist.get_rank(), dist.get_world_size(), device)


class ReplicaShards:
    """This rank's shard of a snapshot replicated over the data-parallel ranks, and the collective restore.

    Args:
        rank (`int`): this rank.
        world_size (`int`): the data-parallel ranks (the default process group).
        device (`torch.device`): where the model lives (the device of the agreement collective).
        piece_bytes (`int`): the most bytes of a piece ([`shard_layout`]).
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, piece_bytes: int = PIECE_BYTES):
        self.rank, self.world_size, self.device, self.piece_bytes = rank, world_size, device, piece_bytes
        self.step = -1  # the step of the snapshot whose shard this rank holds (-1: none)
        self.keys: list[tuple] = []  # ("param", name) or ("optimizer", index, key), one per sharded tensor
        self.specs: list[TensorSpec] = []
        self.pieces: list[Piece] = []
        self.held: list[torch.Tensor] = []  # host copies of this rank's pieces, in layout order
        self.optimizer: dict[int, dict[str, Any]] = {}  # per parameter index: a TensorSpec, a host copy or a value
        self.names: set[str] = set()  # the parameters the snapshot holds
        self.host: HostBuffers | None = None

    @property
    def total_bytes(self) -> int:
        """The bytes of the sharded tensors on one rank (S, what an unsharded snapshot would copy of them)."""
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in self.specs)

    def take(self, live: dict[str, Any], host: HostBuffers, step: int, stream: Any = None) -> None:
        """Copy this rank's pieces of `live` (`{"params": {name: tensor}, "optimizer": {index: {key: value}}}`) and
        the 0-dim tensors into `host` (non-blocking from a CUDA device: the caller records an event after it;
        `stream`: the side stream to queue them on, `runtime/copy_stream.py`)."""
        # The previous shard's views go first: a new layout's buffers are then allocated once the old ones are freed.
        self.step, self.host, self.held, self.optimizer = -1, host, [], {}
        entries = [(("param", n), t) for n, t in live["params"].items()]
        entries += [(("optimizer", i, k), v) for i, slot in live["optimizer"].items() for k, v in slot.items()]
        sharded = [(key, t.detach()) for key, t in entries if torch.is_tensor(t) and t.dim() > 0]
        small = [(key, t.detach()) for key, t in entries if torch.is_tensor(t) and t.dim() == 0]
        sizes = [(t.numel(), t.element_size()) for _, t in sharded]
        self.pieces = shard_layout(sizes, self.world_size, self.piece_bytes)
        own = [p for p in self.pieces if p.owner == self.rank]
        wanted = [((p.stop - p.start,), sharded[p.tensor][1].dtype) for p in own] + [((), t.dtype) for _, t in small]
        views = host.views(wanted, pin=any(t.is_cuda for _, t in sharded + small))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            pairs = [(v, _flat(sharded[p.tensor][1])[p.start : p.stop]) for p, v in zip(own, views)]
            pairs += [(view, t) for (_, t), view in zip(small, views[len(own) :])]
            copies = [queue_host_copy(view, source, stream) for view, source in pairs]
        self.held = copies[: len(own)]
        self.keys = [key for key, _ in sharded]
        self.specs = [TensorSpec(tuple(t.shape), t.dtype, t.device, stride=t.stride()) for _, t in sharded]
        specs = dict(zip(self.keys, self.specs))
        for (key, t), held in zip(small, copies[len(own) :]):
            specs[key] = TensorSpec((), t.dtype, t.device, held)
        self.optimizer = {
            i: {k: specs.get(("optimizer", i, k)) or copy.deepcopy(v) for k, v in slot.items()}
            for i, slot in live["optimizer"].items()
        }
        self.names = set(live["params"])
        self.step = step

    def drop(self) -> None:
        """Forget this rank's shard and free its host memory, as a process that replaced this one would have none
        (a rollback then loads the newest verified checkpoint instead)."""
        self.step, self.held = -1, []
        if self.host is not None:
            self.host.release()

    def missing(self) -> list[int]:
        """The ranks that do not hold their shard of the newest snapshot any rank holds (a collective: every rank
        calls it, at a rollback). Empty when the restore from the shards can go ahead."""
        steps = gathered(torch.tensor([float(self.step)], dtype=torch.float64, device=self.device)).reshape(-1)
        newest = max(steps.tolist())
        return [rank for rank, step in enumerate(steps.tolist()) if step < 0 or step != newest]

    @torch.no_grad()
    def restore(self, model: torch.nn.Module, optimizer: Any) -> None:
        """Put the whole snapshot back on every rank (a collective): the optimizer state's layout first (entries the
        snapshot lacks removed, missing tensors recreated), then each piece copied in by its owner and broadcast."""
        all_params = [p for group in param_groups(optimizer) for p in group["params"]]
        for i, param in enumerate(all_params):
            slot = self.optimizer.get(i)
            if slot is None:
                optimizer.state.pop(param, None)
                continue
            live = optimizer.state.setdefault(param, {})
            for key, value in slot.items():
                live[key] = _restored(live.get(key), value)
        named = dict(model.named_parameters())
        targets = [named[k[1]] if k[0] == "param" else optimizer.state[all_params[k[1]]][k[2]] for k in self.keys]
        held = iter(self.held)
        for piece in self.pieces:
            target = _flat(targets[piece.tensor])[piece.start : piece.stop]
            if piece.owner == self.rank:
                target.copy_(next(held), non_blocking=True)
            dist.broadcast(target, src=piece.owner)


def shard_fallback(snapshot: Any, step: int) -> CheckpointSource | None:
    """At a rollback (every rank, a collective): `None` when every rank holds its shard of the same snapshot, so the
    restore goes ahead from the shards; else, after a warning and a `shard_missing` event, the disk source whose
    newest verified checkpoint the rollback loads instead (which stops the run when there is none).

    Args:
        snapshot ([`HostSnapshot`]): the sharded host snapshot (its model, backend, event log, output directory,
            the checkpoints this run published or resumed from, and its [`ReplicaShards`]).
        step (`int`): the optimizer step of the rollback.
    """
    shards: ReplicaShards = snapshot.replicas
    missing = shards.missing()
    if not missing:
        return None
    disk = CheckpointSource(snapshot.model, snapshot.backend, snapshot.events, snapshot.output_dir)
    disk.good = [path for path in snapshot.checkpoints if path]
    path = disk.newest_good(step)
    detail = {"reason": "shard_missing", "snapshot_step": shards.step, "loads": path}
    if snapshot.events is not None:
        snapshot.events.add(RunEvent(step, "shard_missing", [], missing, detail))
    logger.warning(
        f"NaN guard: rank(s) {missing} of {shards.world_size} no longer hold their shard of the host snapshot, which "
        "the data-parallel ranks share out (a restarted process, or snapshots of different steps), so the state "
        f"cannot be put back from memory: rolling back to the newest verified checkpoint instead ({path or 'none'}), "
        'as `nan_rollback_from="checkpoint"` does. The steps since that checkpoint are discarded.'
    )
    return disk


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as one dimension in its memory order, sharing its storage (a write into a slice of it writes the
    tensor): a dense tensor in another layout than the contiguous one (channels_last, and the moments that keep it)
    is first permuted into the order of its strides."""
    if not tensor.is_contiguous():
        tensor = tensor.permute(sorted(range(tensor.dim()), key=tensor.stride, reverse=True))
    return tensor.view(-1)


def _restored(current: Any, saved: Any) -> Any:
    """The live optimizer-state value after a restore of `saved` over `current`: a tensor of the snapshot's shape
    (a sharded one's values come with the pieces after), a 0-dim one's host copy put back, any other value copied."""
    if not isinstance(saved, TensorSpec):
        return copy.deepcopy(saved)
    same = torch.is_tensor(current) and tuple(current.shape) == saved.shape and current.dtype == saved.dtype
    if same and saved.value is None and current.stride() == saved.stride:  # the pieces' memory order: the same
        return current
    if same and saved.value is not None:
        return current.copy_(saved.value, non_blocking=True)
    if saved.value is None:
        return torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype, device=saved.device)
    # A copy, never the host view itself (the next snapshot overwrites it), on the device it came from.
    return saved.value.to(saved.device, copy=True)


__all__ = ["PIECE_BYTES", "Piece", "ReplicaShards", "TensorSpec", "replica_shards", "shard_fallback", "shard_layout"]
