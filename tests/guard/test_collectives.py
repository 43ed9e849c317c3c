"""`runtime/collectives.py` on its own: the three collectives the guard and the restarts use, in a single process (where
they are the identity and no process group is needed) and across two real gloo ranks.

The two-rank case starts two processes (`spawn`) that meet through a `FileStore` under `tmp_path` (no TCP port to
race for), each with a 60 s collective timeout; the parent joins them with a timeout, checks their exit codes and
reads what each rank saw from a JSON file it wrote.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from safe_trainers.runtime.collectives import distributed, max_across_ranks, mean_across_ranks, ranks_with_flag
from safe_trainers.guard.step.flags import StepFlags

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------------------------- one process
def test_without_a_process_group_nothing_is_distributed():
    assert not dist.is_initialized()
    assert distributed() is False


def test_ranks_with_flag_names_rank_0_for_each_set_flag():
    assert ranks_with_flag(torch.tensor([True, False, True])) == [[0], [], [0]]
    assert ranks_with_flag(torch.tensor([0.0, 1.0])) == [[], [0]]  # any truthy value is a set flag
    assert ranks_with_flag(torch.zeros(0, dtype=torch.bool)) == []


def test_max_and_mean_are_the_tensor_itself_in_one_process():
    values = torch.tensor([0.0, 1.0, NAN, INF])
    # No copy and no host read: the same tensor object comes back, NaN and inf untouched.
    assert max_across_ranks(values) is values
    assert mean_across_ranks(values) is values


# ---------------------------------------------------------------------------------------------------- two gloo ranks
WORLD = 2
# Per rank: the loss flags of 4 steps, as `StepFlags.read` gathers them (bool tensors, as every caller passes them).
FLAGS = {0: [True, False, True, False], 1: [False, False, True, True]}
# Per rank: values for the element-wise maximum, including the edge cases (negative, -inf, inf, one rank's NaN).
MAX_IN = {0: [0.0, 1.0, -3.0, -INF, INF, NAN, 2.0], 1: [1.0, 0.0, -5.0, 4.0, 1.0, 2.0, NAN]}
MEAN_IN = {0: [1.0, 2.0, -4.0], 1: [3.0, 6.0, 4.0]}


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    """One rank: run each collective on its inputs and write what came back (or the traceback) to `rank{r}.json`."""
    result: dict = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        result["distributed"] = distributed()
        result["ranks_with_flag"] = ranks_with_flag(torch.tensor(FLAGS[rank]))
        result["single_flag"] = ranks_with_flag(torch.tensor([rank == 1]))  # the shape guard.py and preemption use
        values = torch.tensor(MAX_IN[rank])
        maximum = max_across_ranks(values)
        result["max"] = maximum.tolist()
        result["max_input_kept"] = values.tolist()  # the all-reduce works on a copy
        result["max_is_copy"] = maximum is not values
        mean_in = torch.tensor(MEAN_IN[rank])
        result["mean"] = mean_across_ranks(mean_in).tolist()
        result["mean_input_kept"] = mean_in.tolist()
        # The guard's own use: rank 1's loss is NaN, rank 0's finite; the flags ride as 0/1 and the loss as
        # `nan_to_num`, so every rank must see the fault whatever MAX does with a NaN.
        flags = StepFlags()
        flags.observe_loss(torch.tensor(NAN if rank == 1 else 1.5))
        result["guard_fault"] = bool(flags.end_step(1, torch.tensor(0.5), torch.device("cpu")))
        flags.observe_loss(torch.tensor(2.0 + rank))  # a healthy step: the agreed loss is the largest rank's
        result["guard_healthy"] = bool(flags.end_step(2, torch.tensor(0.5), torch.device("cpu")))
        records = flags.read()
        result["guard_records"] = [(r.step, r.bad, list(r.bad_ranks)) for r in records]
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - any failure on a rank is written for the parent to report
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, dict]:
    """What each of two gloo ranks saw (see `_rank_main`)."""
    tmp = tmp_path_factory.mktemp("gloo")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp / "store"), str(tmp))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * WORLD, f"gloo ranks exited with {codes} (a negative code is a signal; None: hung)"
    results = {}
    for rank in range(WORLD):
        with open(tmp / f"rank{rank}.json") as f:
            results[rank] = json.load(f)
        assert "error" not in results[rank], f"rank {rank} failed:\n{results[rank]['error']}"
    return results


@pytest.mark.slow  # a process of its own, or a real run
def test_two_ranks_are_distributed(two_ranks):
    assert [two_ranks[r]["distributed"] for r in range(WORLD)] == [True, True]


def test_ranks_with_flag_gives_each_step_the_ranks_whose_flag_is_set(two_ranks):
    for rank in range(WORLD):  # the same table on every rank
        assert two_ranks[rank]["ranks_with_flag"] == [[0], [], [0, 1], [1]]
        assert two_ranks[rank]["single_flag"] == [[1]]


def _same(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def test_max_is_the_element_wise_maximum_on_a_copy(two_ranks):
    for rank in range(WORLD):
        got = two_ranks[rank]["max"]
        assert got[:5] == [1.0, 1.0, -3.0, 4.0, INF]  # finite, negative, -inf and inf values
        assert _same(two_ranks[rank]["max_input_kept"], MAX_IN[rank]) and two_ranks[rank]["max_is_copy"]
    assert _same(two_ranks[0]["max"], two_ranks[1]["max"])  # every rank agrees, NaN positions included


def test_a_nan_on_one_rank_is_not_reliably_the_maximum(two_ranks):
    """Found with this test (torch 2.13, gloo): MAX does not propagate a NaN. Which rank holds it decides: a NaN on
    rank 0 against 2.0 on rank 1 comes back as 2.0, a NaN on rank 1 against 2.0 comes back as NaN (every comparison
    with NaN is false, so the running value is kept). A NaN therefore cannot serve as a flag: the guard folds
    non-finite values into 0/1 flags and sends the loss through `nan_to_num` before the all-reduce
    (`StepFlags.end_step`), which the next test checks across the two ranks."""
    nan_on_rank0, nan_on_rank1 = two_ranks[0]["max"][5], two_ranks[0]["max"][6]
    outcomes = [math.isnan(nan_on_rank0), math.isnan(nan_on_rank1)]
    assert outcomes.count(True) <= 1, "NaN now propagates through gloo's MAX from both ranks: update this docstring"
    assert outcomes.count(True) == 1, f"NaN dropped whichever rank holds it: {two_ranks[0]['max'][5:]}"
    assert (nan_on_rank1 if outcomes[0] else nan_on_rank0) == 2.0  # the NaN was dropped: the finite value stands


def test_the_guard_flags_a_nan_loss_on_one_rank_on_every_rank(two_ranks):
    for rank in range(WORLD):
        assert two_ranks[rank]["guard_fault"] is True  # rank 0's loss was finite: it still skips
        assert two_ranks[rank]["guard_healthy"] is False
        assert two_ranks[rank]["guard_records"] == [[1, True, [1]], [2, False, []]]


def test_mean_is_the_element_wise_mean_on_a_copy(two_ranks):
    for rank in range(WORLD):
        assert two_ranks[rank]["mean"] == [2.0, 4.0, 0.0]
        assert two_ranks[rank]["mean_input_kept"] == MEAN_IN[rank]
