"""Spike detection leaves a healthy GRPO run alone. Real training on CPU.
"""

from __future__ import annotations

from safe_trainers.testing.build import build_trainer
from safe_trainers.guard import read_events


def test_spike_detection_leaves_a_healthy_grpo_run_alone(toy_models, tmp_path):
    trainer = build_trainer(
        "grpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        max_steps=40,
        nan_spike_factor=6.0,
        save_strategy="no",
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert min(losses) < 0 or max(abs(x) for x in losses) < 0.05  # GRPO losses: near 0 and of either sign
    assert not read_events(str(tmp_path)) and trainer.state.global_step == 40
