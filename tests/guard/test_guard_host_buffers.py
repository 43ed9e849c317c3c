"""The host layout of the guard's copies (`safe_trainers.runtime.host_buffers`): one buffer per dtype, sized exactly,
a view per tensor, allocated once and reused; and a snapshot's restore into the live tensors
(`guard/rollback/memory.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from safe_trainers.runtime.host_arena import HostArena
from safe_trainers.runtime.host_buffers import HostBuffers, copy_to_host, plan, queue_host_copy
from safe_trainers.guard.rollback.memory import _restored


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool]


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 1e3).to(dtype)


SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)  # 0-dim and empty tensors included


@given(st.lists(st.tuples(SHAPES, st.sampled_from(DTYPES)), min_size=1, max_size=12))
def test_one_exact_buffer_per_dtype_and_every_tensor_a_view_of_it(specs):
    sizes, slots = plan(specs)
    assert list(sizes) == list(dict.fromkeys(dtype for _, dtype in specs))  # dtypes in order of first appearance
    buffers = HostBuffers()
    views = buffers.views(specs)
    assert set(buffers.buffers) == set(sizes)
    # Sized exactly: the buffers' bytes are the tensors' bytes.
    assert buffers.nbytes() == sum(v.numel() * v.element_size() for v in views)
    for view, (shape, dtype), slot in zip(views, specs, slots):
        buffer = buffers.buffers[dtype]
        assert view.shape == shape and view.dtype == dtype and view.is_contiguous()
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # aliases the buffer
        assert view.storage_offset() == buffer.storage_offset() + slot.offset  # at its slot, empty views too
        if view.numel():  # torch reports an empty tensor's `data_ptr()` as 0, wherever it points
            assert view.data_ptr() == buffer.data_ptr() + slot.offset * buffer.element_size()
        assert view.data_ptr() % view.element_size() == 0  # aligned for its dtype
    # No two views overlap: together they tile each buffer.
    for dtype, n in sizes.items():
        ranges = sorted((s.offset, s.offset + s.numel) for s in slots if s.dtype == dtype)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
        assert sum(end - start for start, end in ranges) == n


@given(st.lists(st.tuples(SHAPES, st.sampled_from(DTYPES)), min_size=1, max_size=8), st.integers(0, 2**16))
def test_copies_round_trip_exactly_for_mixed_dtypes_and_0_dim_tensors(specs, seed):
    tensors = [_random(shape, dtype, seed + i) for i, (shape, dtype) in enumerate(specs)]
    state = {"params": {f"p{i}": t for i, t in enumerate(tensors)}, "optimizer": {0: {"lr": 0.1, "step": tensors[0]}}}
    held = copy_to_host(state, HostBuffers())
    assert held["optimizer"][0]["lr"] == 0.1  # other leaves are copied as they are
    for i, tensor in enumerate(tensors):
        copy = held["params"][f"p{i}"]
        assert copy.data_ptr() != tensor.data_ptr() or tensor.numel() == 0  # a copy, not the tensor
        assert torch.equal(copy, tensor) and copy.dtype == tensor.dtype and copy.shape == tensor.shape
        live = torch.zeros_like(tensor)
        assert _restored(live, copy, tensor, None) is live  # copied into the live tensor
        assert torch.equal(live, tensor)


def test_buffers_are_allocated_once_and_reused_while_the_layout_holds():
    buffers = HostBuffers()
    params = {"w": torch.randn(4, 3), "b": torch.randn(3), "h": torch.randn(2, dtype=torch.bfloat16)}
    first = copy_to_host(params, buffers)
    pointers = {d: b.data_ptr() for d, b in buffers.buffers.items()}
    params["w"].add_(1.0)
    second = copy_to_host(params, buffers)
    assert {d: b.data_ptr() for d, b in buffers.buffers.items()} == pointers  # the same memory, overwritten
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], params["w"])
    # A new layout (the optimizer's moments appear after its first step) is laid out anew, exactly.
    params["m"] = torch.randn(4, 3)
    third = copy_to_host(params, buffers)
    assert buffers.nbytes() == sum(t.numel() * t.element_size() for t in params.values())
    assert all(torch.equal(third[k], v) for k, v in params.items())


def test_buffers_prepared_on_a_thread_are_taken_by_the_first_copy_of_their_layout():
    params = {"w": torch.randn(4, 3), "b": torch.randn(3), "h": torch.randn(2, dtype=torch.bfloat16)}
    buffers = HostBuffers()
    buffers.prepare([(tuple(t.shape), t.dtype) for t in params.values()])
    copied = copy_to_host(params, buffers)
    assert (buffers.allocations, buffers.allocation_seconds) == (1, 0.0)  # allocated off the copy's path
    assert all(torch.equal(copied[k], v) for k, v in params.items())
    # Prepared for a layout that changed before the first copy: dropped, and the copy allocates its own.
    stale = HostBuffers()
    stale.prepare([((7,), torch.float32)])
    copied = copy_to_host(params, stale)
    assert stale.allocations == 1 and stale.allocation_seconds > 0.0
    assert stale.nbytes() == sum(t.numel() * t.element_size() for t in params.values())
    assert all(torch.equal(copied[k], v) for k, v in params.items())


def test_restore_copies_into_the_live_tensor_and_keeps_its_device_and_dtype():
    param = torch.nn.Parameter(torch.randn(4, 3))
    host = copy_to_host({"exp_avg": torch.randn(4, 3), "step": torch.tensor(7.0)}, HostBuffers())
    live_avg, live_step = torch.zeros(4, 3), torch.tensor(0.0, dtype=torch.float64)
    avg_ptr = live_avg.data_ptr()
    assert _restored(live_avg, host["exp_avg"], param, None) is live_avg and live_avg.data_ptr() == avg_ptr
    assert _restored(live_step, host["step"], param, None) is live_step
    assert live_step.dtype == torch.float64 and live_step.item() == 7.0  # the live dtype is kept


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_missing_live_tensor_is_recreated_where_it_was_copied_from(device):
    # `meta` stands in for a GPU here: AdamW's 0-dim `step` lives on the GPU under fused and capturable AdamW, and
    # a restore that finds no live `step` must put it back there, not on the CPU where the host copy is.
    param = torch.nn.Parameter(torch.randn(2))
    host = copy_to_host({"step": torch.tensor(5.0)}, HostBuffers())
    restored = _restored(None, host["step"], param, (torch.device(device), False))
    assert restored.device.type == device and restored.shape == ()
    assert restored.data_ptr() != host["step"].data_ptr() or device == "meta"  # never the host view itself
    if device == "cpu":
        host["step"].fill_(6.0)  # the next snapshot overwrites the host buffer...
        assert restored.item() == 5.0  # ...not the restored state


def test_the_arena_grows_to_the_largest_window_then_holds_one_exact_buffer_per_dtype():
    arena = HostArena()  # CPU tensors here: the same layout, unpinned
    window = [torch.arange(4), torch.arange(5), torch.ones(3)]
    copies = [arena.copy(t) for t in window]
    assert all(torch.equal(c, t) and c.data_ptr() != t.data_ptr() for c, t in zip(copies, window))
    assert len(arena.overflow) == 3 and arena.nbytes() == 9 * 8 + 3 * 4  # nothing fit yet: one exact buffer each
    arena.reset()
    assert arena.overflow == [] and arena.capacity == {torch.int64: 9, torch.float32: 3}
    assert arena.nbytes() == 9 * 8 + 3 * 4  # grown to exactly the window's total per dtype
    pointers = {d: b.data_ptr() for d, b in arena.main.buffers.items()}
    for _ in range(2):  # the next windows, no larger: reused, nothing allocated
        again = [arena.copy(t) for t in window[::-1]]
        assert arena.overflow == [] and all(arena.holds(c) for c in again)
        assert all(torch.equal(c, t) for c, t in zip(again, window[::-1]))
        arena.reset()
    assert {d: b.data_ptr() for d, b in arena.main.buffers.items()} == pointers
    arena.copy(torch.arange(12))  # a larger window: one more exact buffer, then the arena grows to it
    arena.reset()
    assert arena.capacity[torch.int64] == 12 and arena.nbytes() == 12 * 8 + 3 * 4


def test_both_destinations_copy_through_the_one_copy_and_hold_a_copy_not_the_source():
    source = torch.arange(6.0).view(2, 3)
    destination = torch.empty(2, 3)
    assert queue_host_copy(destination, source) is destination
    arena, buffers = HostArena(), HostBuffers()
    copies = [arena.copy(source), copy_to_host(source, buffers), destination]
    source.add_(100)  # the source moves on; every copy keeps the values it had
    for held in copies:
        assert torch.equal(held, torch.arange(6.0).view(2, 3))
        assert held.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    assert buffers.buffers[torch.float32].untyped_storage().data_ptr() == copies[1].untyped_storage().data_ptr()


def test_an_empty_tensor_of_a_dtype_the_arena_has_not_seen_is_copied():
    # A micro-batch may hold an empty tensor (no rows of some input) of a dtype no earlier copy had: it fits in a
    # buffer of 0 elements, and the arena still grows to one exact buffer per dtype.
    arena = HostArena()
    empty = arena.copy(torch.empty(0, 3))
    assert empty.shape == (0, 3) and empty.dtype == torch.float32
    arena.copy(torch.arange(4))
    arena.reset()
    window = [torch.empty(0, 3), torch.empty(2, 0, dtype=torch.int8), torch.arange(4)]
    again = [arena.copy(t) for t in window]
    assert [tuple(c.shape) for c in again] == [(0, 3), (2, 0), (4,)] and torch.equal(again[2], torch.arange(4))
    arena.reset()
    assert arena.capacity == {torch.float32: 0, torch.int64: 4, torch.int8: 0} and arena.nbytes() == 4 * 8


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_local_shards_round_trip(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    param = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    moment = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    held = copy_to_host({"exp_avg": moment}, HostBuffers())
    assert type(held["exp_avg"]) is torch.Tensor and torch.equal(held["exp_avg"], moment.to_local())
    live = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    assert _restored(live, held["exp_avg"], param, None) is live and torch.equal(live.to_local(), moment.to_local())
    rebuilt = _restored(None, held["exp_avg"], param, (torch.device("cpu"), True))
    assert isinstance(rebuilt, DTensor) and rebuilt.placements == param.placements
    assert torch.equal(rebuilt.to_local(), moment.to_local())
