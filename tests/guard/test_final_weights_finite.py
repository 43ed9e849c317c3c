"""Non-finite weights never leave the trainer: damage by the last update is restored before the end, and `save_model`
refuses non-finite weights. Real training on CPU, faults injected.
"""

from __future__ import annotations

import os

import pytest
import torch
from guard_utils import nonfinite_in_checkpoints, weights_finite

from safe_trainers.errors import NonFiniteWeightsError
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events


def test_damage_by_the_last_update_is_restored_before_the_end(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=10, kind="update")]
    )
    trainer.train()
    events = read_events(str(tmp_path))
    assert [(e["step"], e["kind"], e["reason"]) for e in events] == [(10, "rollback", "nonfinite_state")]
    assert weights_finite(trainer)
    trainer.save_model(str(tmp_path / "final"))  # what TRL's scripts do right after train()
    assert not nonfinite_in_checkpoints(str(tmp_path))


def test_save_model_refuses_nonfinite_weights(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=2, save_strategy="no")
    trainer.train()
    with torch.no_grad():
        next(p for p in trainer.model.parameters() if p.requires_grad).view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match="Refusing to save non-finite weights") as error:
        trainer.save_model(str(tmp_path / "final"))
    assert isinstance(error.value, RuntimeError) and error.value.tensors
    assert not os.path.exists(tmp_path / "final" / "model.safetensors")
