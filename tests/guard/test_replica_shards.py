"""The layout of a snapshot sharded over DDP ranks (`guard/rollback/replica_shards.py::shard_layout`): pure properties.

Every element of every tensor is in exactly one piece, a piece is one contiguous element range of one tensor and at
most `piece_bytes` long (or one element), each rank holds at most S/N bytes plus one element, and the layout depends
only on the shapes and dtypes (each rank computes it alone and they must agree). The distributed restore on real
trainers is tests/guard/test_replica_shards_distributed.py; here, one rank's take and restore, piece by piece.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st_

from safe_trainers.guard.rollback.replica_shards import Piece, ReplicaShards, shard_layout
from safe_trainers.runtime.host_buffers import HostBuffers

ELEMENT_SIZES = (1, 2, 4, 8)
sizes_ = st_.lists(st_.tuples(st_.integers(0, 5000), st_.sampled_from(ELEMENT_SIZES)), min_size=0, max_size=12)


def owned_bytes(pieces: list[Piece], sizes: list[tuple[int, int]], world: int) -> list[int]:
    held = [0] * world
    for p in pieces:
        held[p.owner] += (p.stop - p.start) * sizes[p.tensor][1]
    return held


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_, world=st_.integers(1, 9), piece_bytes=st_.integers(1, 3000))
def test_every_element_once_and_each_rank_about_its_share(sizes, world, piece_bytes):
    pieces = shard_layout(sizes, world, piece_bytes)
    for index, (numel, size) in enumerate(sizes):
        ranges = [(p.start, p.stop) for p in pieces if p.tensor == index]
        # contiguous, in order, from 0 to numel: every element exactly once
        assert [start for start, _ in ranges] == ([0] + [stop for _, stop in ranges[:-1]] if numel else [])
        assert (ranges[-1][1] if ranges else 0) == numel
        assert all(stop > start and (stop - start) * size <= max(piece_bytes, size) for start, stop in ranges)
    total = sum(n * s for n, s in sizes)
    biggest = max((s for _, s in sizes), default=0)
    assert all(b <= total / world + biggest for b in owned_bytes(pieces, sizes, world))
    assert sum(owned_bytes(pieces, sizes, world)) == total
    owners = [p.owner for p in pieces]
    assert owners == sorted(owners) and all(0 <= o < world for o in owners)  # each rank one contiguous range
    assert [(p.tensor, p.start) for p in pieces] == sorted((p.tensor, p.start) for p in pieces)
    assert shard_layout(list(sizes), world, piece_bytes) == pieces  # a function of the shapes alone


def test_one_huge_tensor_is_split_across_ranks_and_into_pieces():
    # One 10,000-element fp32 "embedding" and a small bias over 3 ranks, pieces of at most 4 KB (1,024 elements).
    pieces = shard_layout([(10_000, 4), (10, 4)], 3, 4096)
    assert {p.owner for p in pieces if p.tensor == 0} == {0, 1, 2}
    assert max(p.stop - p.start for p in pieces) == 1024
    assert owned_bytes(pieces, [(10_000, 4), (10, 4)], 3) == [13_348, 13_348, 13_344]


def test_one_rank_holds_everything():
    assert shard_layout([(5, 4), (3, 2)], 1) == [Piece(0, 0, 5, 0), Piece(1, 0, 3, 0)]


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (the broadcasts of a restore then copy nothing)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_restore_recreates_missing_moments_and_drops_extra_ones_piece_by_piece(one_rank_group):
    # Pieces of 64 bytes: every tensor is cut into several, copied and put back one by one.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[1].bias.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    shards, host = ReplicaShards(0, 1, torch.device("cpu"), piece_bytes=64), HostBuffers()
    live = {
        "params": {n: p for n, p in model.named_parameters() if p.requires_grad},
        # The third parameter had no state yet when the snapshot was taken (a restore must drop its state).
        "optimizer": {i: dict(optimizer.state[p]) for i, p in enumerate(optimizer.param_groups[0]["params"][:2])},
    }
    shards.take(live, host, step=1)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {i: {k: v.clone() for k, v in slot.items()} for i, slot in live["optimizer"].items()}
    assert host.nbytes() == shards.total_bytes + 4 * len(moments)  # the shards and the 0-dim step counters
    assert max(p.stop - p.start for p in shards.pieces) == 16  # 64 bytes of fp32
    # Damage everything and drop the moments of the first parameter (as a fresh optimizer has none).
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    params = optimizer.param_groups[0]["params"]
    optimizer.state.pop(params[0])
    optimizer.state[params[2]]["exp_avg"].fill_(float("nan"))
    shards.restore(model, optimizer)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, weights[name]), name
    for i, p in enumerate(params[:2]):
        assert set(optimizer.state[p]) == set(moments[i])
        assert all(torch.equal(optimizer.state[p][k], moments[i][k]) for k in moments[i])
    assert params[2] not in optimizer.state
    assert shards.missing() == []
    shards.drop()
    assert shards.missing() == [0] and host.nbytes() == 0


def test_a_channels_last_weight_and_its_moments_come_back_piece_by_piece(one_rank_group):
    # A weight in channels_last memory (`model.to(memory_format=torch.channels_last)`) and AdamW's moments, which keep
    # its layout: no flat view of their elements in logical order. The pieces follow their memory order instead, and
    # a moment recreated by the restore gets the same layout.
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    assert not model.weight.is_contiguous()
    params = optimizer.param_groups[0]["params"]
    moments = {i: dict(optimizer.state[p]) for i, p in enumerate(params)}
    live = {"params": dict(model.named_parameters()), "optimizer": moments}
    shards = ReplicaShards(0, 1, torch.device("cpu"), piece_bytes=64)
    shards.take(live, HostBuffers(), step=1)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {i: {k: v.clone() for k, v in slot.items()} for i, slot in live["optimizer"].items()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    optimizer.state.pop(params[0])  # the weight's moments: recreated by the restore
    optimizer.state[params[1]]["exp_avg"].fill_(float("nan"))
    shards.restore(model, optimizer)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    for i, p in enumerate(params):
        assert all(torch.equal(optimizer.state[p][k], moments[i][k]) for k in moments[i]), i
    assert optimizer.state[params[0]]["exp_avg"].stride() == model.weight.stride()
