"""`runtime/sharding.py`: plain tensors pass through; a `DTensor` (FSDP2's parameters and moments) is read and written
through this rank's shard, and a host copy is placed back like its template, with no collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from net_utils import free_port

from safe_trainers.runtime.sharding import is_sharded, like, local, replicated, reshard


def test_plain_tensors_pass_through_and_copies_land_on_the_templates_device():
    t = torch.arange(4.0)
    assert not is_sharded(t) and local(t) is t and replicated(t) is t
    copy = like(t, torch.ones(4))
    assert copy.device == t.device and torch.equal(copy, torch.ones(4)) and copy.data_ptr() != t.data_ptr()
    reshard(torch.nn.Linear(2, 2))  # a model that is not FSDP2: nothing to do


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dtensor_is_read_and_written_through_its_local_shard(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    param = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
    assert is_sharded(param) and not is_sharded(local(param))
    local(param).mul_(2)  # shares the parameter's storage
    assert torch.equal(param.full_tensor(), torch.arange(6.0).reshape(3, 2) * 2)
    assert torch.equal(replicated(param), param.full_tensor())
    host = local(param).detach().clone() + 1
    placed = like(param, host)
    assert isinstance(placed, DTensor) and placed.placements == param.placements and placed.device_mesh == mesh
    assert torch.equal(local(placed), host) and local(placed).data_ptr() != host.data_ptr()
