"""fp16 with the real CUDA loss scaler (`fp16=True`): its overflows are recorded, never faults, never a rollback; and a
bf16 run (no loss scaler) trains finite."""

from __future__ import annotations

import torch

from safe_trainers.guard import read_events
from safe_trainers.testing.faults import Fault

from gpu_utils import all_finite, logged
from guard_utils import checkpoint_steps, nonfinite_in_checkpoints, weights_finite

from safe_trainers.testing.build import build_trainer


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
        use_cpu=False,
        fp16=True,
        bf16=False,
        learning_rate=1e-5,
        safety_disable_rules=["precision.bf16_over_fp16"],  # which would train in bf16 on this GPU
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


def test_bf16_run_trains_finite(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path), preset="guarded", use_cpu=False, bf16=True, learning_rate=1e-5
    )
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.scaler is None
    assert read_events(str(tmp_path)) == []
    assert all_finite(logged(trainer, "loss")) and all_finite(logged(trainer, "grad_norm"))
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))
