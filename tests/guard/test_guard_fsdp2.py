"""The NaN guard under FSDP2 (`fully_shard`, DTensor parameters), on two CPU ranks (gloo) under torchrun.

accelerate takes its FSDP branch only on accelerator devices, so the workers install `tests/workers/fsdp_on_cpu.py`,
which does on CPU what accelerate does on a GPU machine. Each rank holds its own shard of every parameter and Adam
moment: the guard checks, snapshots and restores the shards, and the ranks agree on every skip and rollback.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
from guard_utils import all_finite_dcp, nonfinite_in_checkpoints
from test_guard_distributed import Within, assert_events, check_in_sync, free_port, launch

from safe_trainers.guard import read_events
from safe_trainers.guard.backends import backend_problem


pytestmark = pytest.mark.distributed


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]


def launch_fsdp2(faults: list[str], tmp_path, *extra: str) -> list[dict]:
    return launch(torchrun(), "dpo", faults, tmp_path, "--fsdp", "SHARDED_STATE_DICT", *extra)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """A NaN loss on rank 1 at step 3, an Inf gradient at step 5, a NaN written into rank 0's shard at step 7
    (snapshots every 2 steps, checkpoints at 4 and 8)."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    results = launch_fsdp2(["loss:3:1", "grad:5:0:inf", "weight:7:0"], tmp)
    return tmp, results


def test_fsdp2_fault_matrix_on_two_ranks(faulty_run):
    tmp, results = faulty_run
    # Ranks agree (the same counters, the same whole weights, finite), and every DCP checkpoint is finite.
    events = check_in_sync(results, 3, 1, tmp / "out")
    assert_events(
        events,
        [(3, "skip", [1]), (5, "skip", []), (7, "skip", Within({0, 1})), (7, "rollback", Within({0, 1}))],
    )
    rollback = events[-1]
    assert 0 in rollback["ranks"] and rollback["restored_step"] == 6 and rollback["reason"] == "nonfinite_state"
    assert events[0]["first_nonfinite_module"]["rank"] == 1  # diagnosed with DTensor parameters
    assert all(r["global_step"] == 8 for r in results)
    checkpoints = sorted(os.listdir(tmp / "out" / "run"))
    assert {"checkpoint-4", "checkpoint-8"} <= set(checkpoints)
    assert os.path.isdir(tmp / "out" / "run" / "checkpoint-8" / "pytorch_model_fsdp_0")  # SHARDED_STATE_DICT


def test_fsdp2_resume_continues_the_batch_stream(faulty_run, tmp_path):
    tmp, reference = faulty_run
    checkpoint = tmp_path / "out" / "run" / "checkpoint-4"
    shutil.copytree(tmp / "out" / "run" / "checkpoint-4", checkpoint)
    resumed = launch_fsdp2(["loss:3:1", "grad:5:0:inf", "weight:7:0"], tmp_path, "--resume", str(checkpoint))
    for rank in (0, 1):
        after = [s for s in reference[rank]["seen"] if s[0] > 4]
        assert resumed[rank]["seen"] == after and after
    # The same faults after step 4 give the same run: same counters, same whole weights.
    assert [(r["skipped"], r["rollbacks"], r["global_step"]) for r in resumed] == [(3, 1, 8)] * 2
    assert resumed[0]["checksum"] == resumed[1]["checksum"]
    assert not nonfinite_in_checkpoints(str(tmp_path / "out"))


def test_fsdp2_grpo_persistent_fault_aborts_with_full_state_dicts(tmp_path):
    # GRPO under FSDP2 with checkpoints and the final model gathered on rank 0 (FULL_STATE_DICT, as the shipped
    # configs/accelerate/fsdp2.yaml). A NaN written into rank 1's shard at step 3, no rollback allowed: GRPO verifies
    # the weights before it samples step 3's completions, finds the damage, and the abort puts back step 2's state.
    results = launch(torchrun(), "grpo", ["weight:3:1"], tmp_path, "--fsdp", "FULL_STATE_DICT", "--max_rollbacks", "0",
                     "--save_final")  # fmt: skip
    run = tmp_path / "out" / "run"
    assert [r["outcome"] for r in results] == [f"diverged: {run / 'checkpoint-2'}"] * 2
    assert all(r["finite"] for r in results) and results[0]["checksum"] == results[1]["checksum"]
    events = read_events(str(run))
    assert [(e["step"], e["kind"], e["restored_step"]) for e in events] == [(2, "abort", 2)]
    assert {"model.safetensors", "pytorch_model_fsdp.bin", "optimizer.bin"} <= set(os.listdir(run / "checkpoint-2"))
    assert os.path.isfile(tmp_path / "out" / "final" / "model.safetensors")  # `save_model` after the abort
    assert not nonfinite_in_checkpoints(str(tmp_path / "out"))


@pytest.mark.parametrize("version,refused", [(None, False), (2, False), (1, True)])
def test_fsdp_version_1_is_refused_naming_fsdp2(version, refused):
    # accelerate refuses to build an FSDP1 plugin on CPU ("no available devices"): the wiring runs on a GPU
    # (tests/gpu); here, the decision.
    problem = backend_problem(fsdp_version=version)
    assert (problem is not None) is refused
    if refused:
        assert "FSDP version 1" in problem and "fsdp_config={'version': 2}" in problem and "nan_guard=False" in problem
    assert backend_problem(zero_stage=0) is not None and backend_problem(zero_stage=3) is None


def test_the_checkpoint_check_sees_nan_in_a_distributed_checkpoint(tmp_path):
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    for value, finite in ((1.0, True), (float("nan"), False)):
        source, target = tmp_path / f"{finite}.pt", tmp_path / f"dcp-{finite}"
        torch.save({"w": torch.full((4,), value), "step": 3}, source)
        torch_save_to_dcp(str(source), str(target))
        assert all_finite_dcp(str(target)) is finite
