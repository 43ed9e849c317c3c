"""Rollback from disk (`nan_rollback_from="checkpoint"`): no host copy; a rollback reloads the newest verified
checkpoint through the Trainer's resume code. Same contract as the in-memory rollback, slower restore, and the steps
since that checkpoint are discarded."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from guard_utils import checkpoint_steps, nonfinite_in_checkpoints, weights_finite
from safetensors.torch import load_file
from transformers import TrainerCallback
from test_guard_distributed import ZERO3, accelerate_ddp, check_in_sync, deepspeed_launcher, launch
from test_guard_fsdp2 import torchrun

import safe_trainers as st
from safe_trainers.guard import read_events
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


def from_disk(kind, toy_models, tmp_path, faults, **overrides):
    model = toy_models["qwen2-rm" if kind == "reward" else "qwen2"]
    return build_trainer(
        kind, model, tmp_path, preset="guarded", faults=faults, nan_rollback_from="checkpoint", **overrides
    )


@pytest.mark.parametrize("kind", ["dpo", "grpo", "reward"])
def test_rollback_reloads_the_newest_checkpoint(toy_models, tmp_path, kind):
    # Checkpoints every 4 steps, a NaN weight at step 7: the in-memory guard would restore its step-6 snapshot; from
    # disk, the last good state is checkpoint-4.
    trainer = from_disk(kind, toy_models, tmp_path, [Fault(step=3, kind="loss"), Fault(step=7, kind="weight")])
    trainer.train()
    events = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    # GRPO samples step 7's completions from the weights verified before its generation batch (at step 6).
    step = 6 if kind == "grpo" else 7
    expected = [(step, 4, [*range(5, step + 1)])]
    assert [(e["step"], e["restored_step"], e["discarded_steps"]) for e in events] == expected
    assert events[0]["learning_rate"] < 1e-3  # backed off
    assert trainer.nan_guard.snapshotter.snapshot.params == {}  # nothing held in host memory
    assert trainer.state.global_step == 10 and weights_finite(trainer)
    # checkpoint-0: the state the run started from, published so that there is always a good state to go back to.
    assert checkpoint_steps(str(tmp_path)) == [0, 4, 8, 10] and not nonfinite_in_checkpoints(str(tmp_path))


def test_a_fault_before_the_first_save_goes_back_to_the_start(toy_models, tmp_path):
    trainer = from_disk("dpo", toy_models, tmp_path, [Fault(step=2, kind="weight")])
    trainer.train()
    rollback = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    assert [(e["restored_step"], e["discarded_steps"]) for e in rollback] == [(0, [1, 2])]
    assert weights_finite(trainer) and trainer.state.global_step == 10


def test_the_restored_state_is_the_checkpoints_and_the_timeline_goes_on(toy_models, tmp_path):
    # No rollback allowed: the abort puts the last good state back and saves it as checkpoint-7, so what the restore
    # produced is on disk: checkpoint-4's weights and optimizer moments, with the LR schedule of step 7.
    trainer = from_disk("dpo", toy_models, tmp_path, [Fault(step=7, kind="weight")], nan_max_rollbacks=0)
    with pytest.raises(st.TrainingDivergedError) as error:
        trainer.train()
    assert error.value.checkpoint_dir.endswith("checkpoint-7")
    good, saved = tmp_path / "checkpoint-4", tmp_path / "checkpoint-7"
    weights = [load_file(str(path / "model.safetensors")) for path in (good, saved)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    moments = [torch.load(path / "optimizer.pt", weights_only=False)["state"] for path in (good, saved)]
    assert all(torch.equal(moments[0][i]["exp_avg"], moments[1][i]["exp_avg"]) for i in moments[0])
    schedules = [torch.load(path / "scheduler.pt", weights_only=False) for path in (good, saved)]
    assert (schedules[0]["last_epoch"], schedules[1]["last_epoch"]) == (4, 7)  # the schedule did not rewind


def test_memory_mode_takes_no_extra_checkpoint(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(7, "weight")])
    trainer.train()
    assert checkpoint_steps(str(tmp_path)) == [4, 8, 10]
    assert [e["restored_step"] for e in read_events(str(tmp_path)) if e["kind"] == "rollback"] == [6]
    assert os.path.isdir(tmp_path / "checkpoint-4")


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["ddp", "zero3", "fsdp2"])
def test_two_ranks_roll_back_to_the_same_checkpoint(tmp_path, launcher):
    extra = ["--rollback_from", "checkpoint"]
    if launcher == "zero3":
        config = tmp_path / "zero3.json"
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
        config.write_text(json.dumps({**ZERO3, "zero_optimization": zero}))
        extra += ["--deepspeed", str(config)]
    if launcher == "fsdp2":
        extra += ["--fsdp", "SHARDED_STATE_DICT"]
    command = {"ddp": accelerate_ddp, "zero3": deepspeed_launcher, "fsdp2": torchrun}[launcher]
    results = launch(command(), "dpo", ["loss:3:1", "weight:7:0"], tmp_path, *extra)
    events = check_in_sync(results, 2, 1, tmp_path / "out")
    rollback = [e for e in events if e["kind"] == "rollback"]
    # Under ZeRO-3 the NaN written into rank 0's fp32 master shard shows one step later (see test_guard_distributed).
    assert [e["restored_step"] for e in rollback] == [4] and 0 in rollback[0]["ranks"]
    assert checkpoint_steps(str(tmp_path / "out" / "run")) == [0, 4, 8]
    assert all(r["global_step"] == 8 for r in results)


def test_an_unknown_rollback_source_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"`nan_rollback_from` must be one of \['memory', 'checkpoint'\], got 'disk'"):
        st.DPOConfig(output_dir=str(tmp_path), nan_rollback_from="disk")


def test_an_earlier_runs_checkpoints_are_never_a_rollback_target(toy_models, tmp_path):
    # Run A (another learning rate) left checkpoints every 2 steps in the same output_dir. Run B rolls back from disk
    # at step 7: its own good states are checkpoint-0 (published at its start), not A's checkpoint-6.
    build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", save_steps=2, learning_rate=5e-2).train()
    assert checkpoint_steps(str(tmp_path)) == [2, 4, 6, 8, 10]
    trainer = from_disk("dpo", toy_models, tmp_path, [Fault(step=7, kind="weight")], save_steps=100)
    trainer.train()
    rollback = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    assert [e["restored_step"] for e in rollback] == [0] and weights_finite(trainer)


class _DamageMoments(TrainerCallback):
    """A bad update of the optimizer state: right after step `step`'s update, one Adam moment holds a NaN."""

    def __init__(self, step: int):
        self.step = step

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step + 1 == self.step:
            inner = getattr(optimizer, "optimizer", optimizer)
            next(iter(inner.state.values()))["exp_avg"].view(-1)[0] = float("nan")


@pytest.mark.parametrize("save_only_model", [False, True])
def test_damaged_optimizer_state_is_restored_or_reset(toy_models, tmp_path, save_only_model):
    # NaN in an Adam moment after step 7 (weights still finite): the rollback loads checkpoint-4's moments, or, when
    # checkpoints hold no optimizer state (`save_only_model=True`), starts them afresh as a resume from such a
    # checkpoint does; never keeps the damaged ones.
    trainer = from_disk("dpo", toy_models, tmp_path, [], save_only_model=save_only_model)
    trainer.add_callback(_DamageMoments(7))
    trainer.train()
    rollback = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    assert [e["restored_step"] for e in rollback] == [4]
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    moments = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    assert moments and all(bool(torch.isfinite(m).all()) for m in moments) and weights_finite(trainer)


class _RemovesCheckpoints(TrainerCallback):
    """Something other than the run (a clean-up job, a user) deletes the run's checkpoints after step `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            for path in glob.glob(os.path.join(args.output_dir, "checkpoint-*")):
                shutil.rmtree(path)


def test_no_good_state_left_on_disk_stops_the_run_with_a_message(toy_models, tmp_path):
    # The run's checkpoints 0 and 4 are deleted behind its back, then NaN weights at step 6: there is nothing to roll
    # back to. The run stops with `TrainingDivergedError` (never an unhandled error) and an `abort` event.
    # Saved synchronously: a background save of checkpoint-4 could be published after the removal at step 5.
    trainer = from_disk("dpo", toy_models, tmp_path, [Fault(step=6, kind="weight")], save_in_background=False)
    trainer.add_callback(_RemovesCheckpoints(5))
    match = r"no good state to roll back to.*`checkpoint-0`, `checkpoint-4`"
    with pytest.raises(st.TrainingDivergedError, match=match):
        trainer.train()
    (abort,) = [e for e in read_events(str(tmp_path)) if e["kind"] == "abort"]
    assert (abort["step"], abort["reason"]) == (6, "no_good_state")


def test_the_damaged_optimizer_state_is_dropped_before_the_checkpoints_is_loaded(toy_models, tmp_path):
    # A rollback from disk must not hold the live (damaged) moments next to the loaded ones: that was twice the
    # optimizer state at once (16 bytes per trainable parameter for AdamW in fp32, on the GPU under DDP), a peak a
    # resumed run never has. Measured where the loaded state meets the optimizer: its `load_state_dict` pre-hook.
    trainer = from_disk("dpo", toy_models, tmp_path, [Fault(step=7, kind="weight")])
    held_at_load: list[int] = []

    class _Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            inner = getattr(optimizer, "optimizer", optimizer)

            def pre_hook(opt, state_dict):
                tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
                held_at_load.append(sum(t.numel() * t.element_size() for t in tensors))

            inner.register_load_state_dict_pre_hook(pre_hook)

    trainer.add_callback(_Watch())
    trainer.train()
    assert [e["restored_step"] for e in read_events(str(tmp_path)) if e["kind"] == "rollback"] == [4]
    assert held_at_load == [0]
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert optimizer.state and weights_finite(trainer)
