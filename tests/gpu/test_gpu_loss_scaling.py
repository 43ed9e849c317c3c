"""fp16 with the real CUDA loss scaler (`fp16=True`): its overflows are recorded, never faults, never a rollback; a
poisoned step (its batches not trained: no backward at all) and a NaN loss are skipped through the scaler's own
`found_inf`; and a bf16 run (no loss scaler) trains finite, a NaN loss skipped by the fused optimizer on the device."""

from __future__ import annotations

import os

import torch

from safe_trainers.guard import read_events
from safe_trainers.restarts.progress import Death, History, ProgressWriter, data_identity
from safe_trainers.restarts.agents import TrainCalls, agent_identity, launch_agents
from safe_trainers.testing.faults import Fault

from gpu_utils import StepStates, all_finite, logged
from guard_utils import checkpoint_steps, nonfinite_in_checkpoints, weights_finite

from safe_trainers.testing.build import build_trainer


FP16 = dict(use_cpu=False, fp16=True, bf16=False, safety_disable_rules=["precision.bf16_over_fp16"])


def killed_twice_in(trainer, step: int, monkeypatch) -> None:
    """Make `trainer`'s process the third attempt of its launch (torchrun's restart 2, the same agent), after attempts
    0 and 1 died feeding `step` (the record the step progress leaves on disk): `step` is poisoned and its batches are
    not trained."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    agents = {}
    for count in (1, 2):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", f"/tmp/torchelastic_gpu/none_gpu/attempt_{count}/0/error.json")
        agents[count] = launch_agents([agent_identity(dict(os.environ))])
    TrainCalls.reset()
    data = data_identity(trainer.args, len(trainer.train_dataset))
    history = History(1, deaths=(Death(0, step),), launch=agents[1], restart=1)
    writer = ProgressWriter(trainer.args.output_dir, history, data)
    writer.write(step, "step")
    writer.close()


def test_fp16_overflows_are_recorded_and_never_rolled_back(toy_models, tmp_path):
    # Inf gradients with a finite loss at steps 3-6: what an overflowing loss scale produces, four times in a row (more
    # than `nan_max_consecutive_skips=3`, which faults would turn into a rollback).
    fault = Fault(step=3, kind="grad", value=float("inf"), repeat=4)
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        str(tmp_path),
        preset="guarded",
        faults=[fault],
        learning_rate=1e-5,
        **FP16,  # `precision.bf16_over_fp16` would train in bf16 on this GPU
    )
    scaler = trainer.accelerator.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    initial_scale = scaler.get_scale()
    trainer.train()
    events = read_events(str(tmp_path))
    overflows = [e["step"] for e in events if e["kind"] == "overflow"]
    # Any overflow of the scaler's own calibration (the first steps at scale 65536) is recorded the same way.
    assert {e["kind"] for e in events} == {"overflow"} and {3, 4, 5, 6} <= set(overflows)
    guard = trainer.nan_guard.state
    assert (guard.overflow_steps, guard.skipped_steps, guard.rollbacks) == (len(overflows), 0, 0)
    # The scaler skipped each of them itself and backed off once per overflow, as in stock training.
    assert scaler.get_scale() == initial_scale * scaler.get_backoff_factor() ** len(overflows)
    assert trainer.state.global_step == 10 and checkpoint_steps(str(tmp_path)) == [4, 8, 10]
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))
    assert all_finite(logged(trainer, "loss"))


def test_fp16_poisoned_step_and_nan_loss_are_skipped_through_the_loss_scaler(toy_models, tmp_path, monkeypatch):
    # Step 3's batches killed the two previous attempts: they are not trained, so no backward records any inf check
    # (stock `GradScaler.update` would raise "No inf checks were recorded prior to update"). Step 6 has a NaN loss.
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        str(tmp_path),
        preset="guarded",
        faults=[Fault(6, "loss")],
        learning_rate=1e-5,
        **FP16,
    )
    scaler = trainer.accelerator.scaler
    killed_twice_in(trainer, 3, monkeypatch)
    states = StepStates(scaler)
    trainer.add_callback(states)
    trainer.train()
    assert trainer.state.global_step == 10
    events = {(e["step"], e["kind"]) for e in read_events(str(tmp_path))}
    assert {(3, "poison"), (3, "skip"), (6, "skip")} <= events
    assert {kind for _, kind in events} <= {"resume", "poison", "skip", "overflow"}  # overflows: the scaler's own
    guard = trainer.nan_guard.state
    assert (guard.skipped_steps, guard.rollbacks) == (2, 0)
    # Neither step changed a weight or an optimizer step count; the scaler counted each as an overflow.
    for step in (3, 6):
        assert states.unchanged(step)
        assert states.scale_factor(step) == scaler.get_backoff_factor()
    assert any(states.applied(step) for step in (4, 5, 7, 8, 9, 10))
    assert "found_inf" not in vars(trainer.optimizer.optimizer)
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))


def test_bf16_run_skips_a_nan_loss_on_the_device_and_trains_finite(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        str(tmp_path),
        preset="guarded",
        faults=[Fault(3, "loss")],
        use_cpu=False,
        bf16=True,
        learning_rate=1e-5,
    )
    assert trainer.args.optim == "adamw_torch_fused"
    states = StepStates()
    trainer.add_callback(states)
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.scaler is None
    assert [(e["step"], e["kind"]) for e in read_events(str(tmp_path))] == [(3, "skip")]
    assert states.unchanged(3) and states.applied(2) and states.applied(4)
    assert "found_inf" not in vars(trainer.optimizer.optimizer)
    others = [e for e in trainer.state.log_history if "loss" in e and e.get("step") != 3 and "train_runtime" not in e]
    assert all_finite([e["loss"] for e in others]) and all_finite([e["grad_norm"] for e in others])
    assert trainer.state.global_step == 10 and checkpoint_steps(str(tmp_path)) == [4, 8, 10]
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))
