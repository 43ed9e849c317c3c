"""The state check (`safe_trainers.runtime.finite.all_finite`): catches every NaN/Inf wherever it sits, never
raises a false alarm on large finite values, and holds at most one bounded piece beyond its inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from safe_trainers.runtime.finite import CHUNK_BYTES, all_finite, flat_chunks

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
BAD = [float("nan"), float("inf"), float("-inf")]
SHAPES = st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple)


@given(SHAPES, st.sampled_from(FLOATS), st.data())
def test_a_single_bad_value_anywhere_is_caught(shape, dtype, data):
    tensor = torch.randn(shape).to(dtype)
    assert bool(all_finite([tensor]))
    index = data.draw(st.integers(0, tensor.numel() - 1))
    tensor.view(-1)[index] = data.draw(st.sampled_from(BAD))
    transposed = tensor.t() if tensor.dim() == 2 else tensor  # the same values, not contiguous
    others = [torch.ones(3), None, torch.arange(4)]  # integers and `None` are skipped
    assert not bool(all_finite([*others, tensor]))
    assert not bool(all_finite([transposed]))


@pytest.mark.parametrize("dtype", FLOATS)
def test_largest_finite_values_are_no_false_alarm(dtype):
    # An L2 norm of these overflows to Inf (the check before computed one, in fp32): a false alarm is as bad as a miss.
    big = torch.finfo(dtype).max
    tensor = torch.full((1000,), big, dtype=dtype)
    tensor[::2] = -big
    assert bool(all_finite([tensor, tensor.view(10, 100).t()]))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_one_byte_floats_are_checked(dtype):
    tensor = torch.full((100,), torch.finfo(dtype).max).to(dtype)
    assert bool(all_finite([tensor]))
    tensor[57] = float("nan")
    assert not bool(all_finite([tensor]))


def test_the_result_is_a_device_flag_and_empty_input_is_finite():
    flag = all_finite([torch.ones(2)])
    assert isinstance(flag, torch.Tensor) and flag.shape == () and flag.dtype == torch.bool
    assert bool(all_finite([])) and bool(all_finite([torch.empty(0), torch.tensor([1, 2])]))


def test_a_bad_value_in_a_later_piece_of_a_large_tensor_is_caught():
    tensor = torch.zeros(CHUNK_BYTES // 4 + 7, dtype=torch.bfloat16)  # two pieces
    assert len(list(flat_chunks(tensor))) == 2 and bool(all_finite([tensor]))
    tensor[-1] = float("inf")
    assert not bool(all_finite([tensor]))


@given(st.lists(st.integers(1, 7), min_size=0, max_size=4), st.integers(1, 20), st.booleans())
def test_pieces_are_views_that_cover_every_element_once(shape, elements, transpose):
    tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, -1)
    pieces = list(flat_chunks(tensor, elements))
    assert all(p.numel() <= max(elements, 1) for p in pieces)
    assert all(p.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() for p in pieces)
    assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), tensor.reshape(-1))


PEAK = """
import json, resource, sys, torch
from safe_trainers.runtime.finite import all_finite
torch.set_num_threads(1)
tensor = torch.empty(128 * 2**20, dtype=torch.bfloat16).uniform_(-1, 1)  # 256 MiB
views = [tensor, tensor.view(2**13, -1).t()] if sys.argv[1] == "transposed" else [tensor]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
finite = bool(all_finite(views))
extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps({"finite": finite, "extra": extra}))
"""


@pytest.mark.slow  # a process of its own, or a real run
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_check_holds_at_most_one_piece_beyond_its_inputs(layout):
    # A fresh process, so that its peak resident memory is this check's: the check before this one made an fp32 copy
    # of every bf16 tensor (512 MiB here).
    done = subprocess.run([sys.executable, "-c", PEAK, layout], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["finite"]
    assert result["extra"] <= CHUNK_BYTES + 16 * 2**20, result
