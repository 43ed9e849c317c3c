"""The guard's host copies and restores on a CUDA device: exactly sized pinned buffers (no caching-allocator block),
fused AdamW's on-device `step` restored on the device, the bounded state check on CUDA.

The same checks passed on an H100 (torch 2.11, CUDA 13), run as a script while this was written; this file itself has
not run on a GPU yet. Skipped without one.
"""

from __future__ import annotations

import types

import pytest
import torch

from safe_trainers.errors import TrainingDivergedError
from safe_trainers.guard.backends import Backend
from safe_trainers.runtime.finite import all_finite
from safe_trainers.runtime.host_arena import HostArena
from safe_trainers.runtime.host_buffers import HostBuffers, _register, _unregister, copy_to_host
from safe_trainers.guard.rollback.memory import HostSnapshot


def test_the_check_is_quiet_on_large_values_and_catches_a_nan_on_cuda():
    big = torch.full((10**6,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16, device="cuda")
    assert bool(all_finite([big, big.view(1000, 1000).t()]))
    big[-1] = float("nan")
    assert not bool(all_finite([torch.ones(3, device="cuda"), big]))


def test_snapshot_buffers_are_pinned_in_place_and_sized_exactly():
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    buffers = HostBuffers()
    tensors = {"a": torch.randn(37_700_000 // 4, device="cuda"), "b": torch.randn(3, device="cuda").bfloat16()}
    held = copy_to_host(tensors, buffers)
    torch.cuda.synchronize()
    assert buffers.pinned and all(b.is_pinned() for b in buffers.buffers.values())
    assert buffers.nbytes() == 37_700_000 + 6  # not the 64 MiB block the caching host allocator would take
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    assert all(torch.equal(held[k], tensors[k].cpu()) for k in tensors)
    buffers.release()
    arena = HostArena()
    copies = [arena.copy(torch.arange(n, device="cuda")) for n in (5, 7)]
    torch.cuda.synchronize()
    assert [torch.equal(c, torch.arange(n)) for c, n in zip(copies, (5, 7))] == [True, True]
    arena.reset()
    assert arena.main.pinned and arena.nbytes() == 12 * 8


def test_fused_adamw_state_is_restored_on_the_device_even_into_an_empty_state():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).cuda()
    model[1].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)

    def step():
        optimizer.zero_grad()
        model(torch.randn(4, 8, device="cuda")).sum().backward()
        optimizer.step()

    step()
    backend = Backend(optimizer, zero_stage=None, loss_scaled=False)
    snapshotter, state = HostSnapshot(model, backend), types.SimpleNamespace(global_step=1)
    snapshotter.take(state)
    good = [p.detach().clone() for p in model.parameters()]
    assert "1.weight" not in snapshotter.snapshot.params and snapshotter.host.pinned  # frozen: not copied
    snapshotter.before_write()  # as the trainer does before its update: the copies (on a side stream) finish first
    step()
    snapshotter.restore(state)
    assert all(torch.equal(a, b) for a, b in zip(good, model.parameters()))
    optimizer.state.clear()  # no live tensor to copy into: recreated where it was taken from
    snapshotter.restore(state)
    assert {s["step"].device.type for s in optimizer.state.values()} == {"cuda"}
    step()  # fused AdamW refuses a `step` on the CPU
    with torch.no_grad():
        model[1].weight.view(-1)[0] = float("nan")
    with pytest.raises(TrainingDivergedError, match="`1.weight`"):
        snapshotter.restore(state)


def test_a_refused_page_lock_leaves_no_cuda_error_behind():
    # A refused `cudaHostRegister` (here: the range is registered already; in production a locked-memory limit)
    # leaves its error in the runtime's last-error slot, and torch raised it at its next kernel launch, in an
    # unrelated operation: the pageable fallback crashed the run instead. Not run on a GPU yet (written without one).
    buffer = torch.empty(1024)
    assert _register(buffer)
    try:
        assert not _register(buffer)
        assert torch.equal(torch.ones(4, device="cuda") * 2, torch.full((4,), 2.0, device="cuda"))
    finally:
        _unregister([buffer])
