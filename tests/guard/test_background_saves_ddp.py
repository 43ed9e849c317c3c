"""Background saves under DDP (`accelerate launch --multi_gpu`, two CPU ranks on gloo): rank 0 writes and publishes
on its writer thread while both ranks train; every rank's readers (`on_save`, the step record, the rotation) are told
at the same step, once the checkpoint is published, from the writers' bit agreed on the guard's all-reduce
(`restarts/writers_done.py`); a write that fails on rank 0 stops both ranks with the same error."""

from __future__ import annotations

import os

import pytest
from guard_utils import checkpoint_steps, nonfinite_in_checkpoints
from test_guard_distributed import accelerate_ddp, launch

from safe_trainers.runtime.checkpoint_dirs import STAGING_DIR

pytestmark = pytest.mark.distributed


def test_two_ranks_train_on_while_rank_0_writes_and_both_hear_of_it_at_the_same_step(tmp_path):
    # checkpoint-10's writer is held on rank 0 until step 12 ends, while both ranks train on; `on_save` of
    # checkpoint-10 comes on both ranks at the same step, once it is published, before the next save would force it
    # (from the writers' agreed bit), with both ranks' RNG states in it.
    extra = ("--max_steps", "20", "--save_steps", "10", "--hold_save", "10:12")
    results = launch(accelerate_ddp(), "dpo", [], tmp_path, *extra)
    run = str(tmp_path / "out" / "run")
    assert [r["outcome"] for r in results] == ["finished"] * 2 and all(r["background"] for r in results)
    assert results[0]["held"] and results[0]["checksum"] == results[1]["checksum"]
    assert results[0]["on_save"] == results[1]["on_save"]  # the same checkpoints, announced at the same steps
    announced = {step: (at, published) for step, at, published in results[0]["on_save"]}
    assert sorted(announced) == [10, 20] and all(published for _, published in announced.values())
    assert 12 < announced[10][0] < 20  # training went on while it was written; told before the next save
    assert checkpoint_steps(run) == [10, 20] and not nonfinite_in_checkpoints(run)
    for step in (10, 20):
        files = set(os.listdir(os.path.join(run, f"checkpoint-{step}")))
        assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "model.safetensors"} <= files
    assert not os.path.exists(os.path.join(run, STAGING_DIR))


def test_the_same_checkpoints_as_a_synchronous_save(tmp_path):
    # The files a synchronous save writes, with the same tensors: what a stock Trainer resumes from.
    from safetensors.torch import load_file

    background = launch(accelerate_ddp(), "dpo", [], tmp_path / "background", "--max_steps", "8")
    synchronous = launch(accelerate_ddp(), "dpo", [], tmp_path / "sync", "--max_steps", "8", "--sync_saves")
    assert [r["background"] for r in background + synchronous] == [True, True, False, False]
    for step in (4, 8):
        dirs = [str(tmp_path / name / "out" / "run" / f"checkpoint-{step}") for name in ("background", "sync")]
        assert set(os.listdir(dirs[0])) == set(os.listdir(dirs[1]))
        weights = [load_file(os.path.join(d, "model.safetensors")) for d in dirs]
        assert all(weights[0][k].equal(weights[1][k]) for k in weights[1])


def test_a_write_that_fails_on_rank_0_stops_both_ranks_and_publishes_nothing(tmp_path):
    results = launch(accelerate_ddp(), "dpo", [], tmp_path, "--max_steps", "12", "--fail_save", "8")
    run = str(tmp_path / "out" / "run")
    assert all(r["outcome"].startswith("write failed: The background save of checkpoint-8 failed") for r in results)
    assert "No space left on device (injected)" in results[0]["outcome"]
    assert "failed on rank 0" in results[1]["outcome"]
    assert checkpoint_steps(run) == [4]  # the previous checkpoint stands
    assert 8 < results[0]["global_step"] == results[1]["global_step"] < 12
