"""`train()` then `save_model()` always writes a finite model (issue 12, item 10), and a save or evaluation never sees
a state damaged after the guard's check: a callback later in the list than the guard's (weight averaging, a user's
own hook) can change the weights after the guard verified them, at `on_step_end` or at `on_train_end`."""

from __future__ import annotations

import os

import pytest
import torch
from guard_utils import checkpoint_steps, nonfinite_in_checkpoints, weights_finite
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import TrainerCallback

from safe_trainers.guard import read_events
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import first_frozen_matrix
from safe_trainers.trainer import inspection


class DamageAfterTheGuard(TrainerCallback):
    """Writes NaN into one weight at `on_step_end` of step `step`, or at `on_train_end` (`step=None`)."""

    def __init__(self, step: int | None):
        self.step = step

    @staticmethod
    def damage(model) -> None:
        with torch.no_grad():
            next(p for p in model.parameters() if p.requires_grad).view(-1)[0] = float("nan")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.damage(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.step is None:
            self.damage(model)


def saved_model_is_finite(path: str) -> bool:
    tensors = load_file(os.path.join(path, "model.safetensors"))
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


@pytest.mark.parametrize(
    "when,kind",
    # At the last `on_step_end` the epoch-end boundary (still inside the training loop) verifies afresh and rolls back;
    # at `on_train_end` only the check when `train()` returns can see it.
    [(6, "rollback"), (None, "restore")],
    ids=["last_on_step_end", "on_train_end"],
)
def test_damage_after_the_last_check_is_restored_before_train_returns(toy_models, tmp_path, when, kind):
    # No save at the end (a save verifies afresh first: see the next test).
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=6, save_strategy="no")
    trainer.add_callback(DamageAfterTheGuard(when))  # appended: runs after the guard's callback
    trainer.train()
    assert weights_finite(trainer) and trainer.state.global_step == 6
    trainer.save_model(str(tmp_path / "final"))  # raised `NonFiniteWeightsError` before
    assert saved_model_is_finite(str(tmp_path / "final"))
    (event,) = [e for e in read_events(str(tmp_path)) if e["kind"] in ("rollback", "restore")]
    assert (event["kind"], event["step"], event["restored_step"]) == (kind, 6, 6)
    assert "weights_or_optimizer_state" in event["nonfinite"]
    if kind == "restore":
        assert event["reason"] == "damaged_after_last_check" and event["restored_from"] == "snapshot"


def test_a_save_after_a_later_callbacks_damage_sees_the_restored_state(toy_models, tmp_path):
    # Damage at `on_step_end` of step 4, after the guard verified step 4 and before checkpoint-4 is written: the save
    # verifies afresh, so the damage is rolled back (to the snapshot of step 4) instead of reaching the checkpoint.
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=6, save_steps=4)
    trainer.add_callback(DamageAfterTheGuard(4))
    trainer.train()
    assert checkpoint_steps(str(tmp_path)) == [4, 6] and not nonfinite_in_checkpoints(str(tmp_path))
    (rollback,) = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    assert (rollback["step"], rollback["restored_step"], rollback["reason"]) == (4, 4, "nonfinite_state")
    assert weights_finite(trainer) and trainer.state.global_step == 6


def test_the_end_check_leaves_a_healthy_run_alone(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=4, save_steps=4)
    trainer.train()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    inspection.finish(trainer)  # what `train()` did at its end: no event, no change
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert not [e for e in read_events(str(tmp_path)) if e["kind"] == "restore"]


def test_with_load_best_model_at_end_the_best_checkpoint_is_put_back(toy_models, tmp_path):
    # The run ends on the best checkpoint's weights; damage after that (at `on_train_end`) must restore those, not the
    # last step's snapshot.
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        eval_rows=4,
        max_steps=6,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
    )
    trainer.add_callback(DamageAfterTheGuard(None))
    trainer.train()
    (event,) = [e for e in read_events(str(tmp_path)) if e["kind"] == "restore"]
    best = trainer.state.best_model_checkpoint
    assert event["restored_from"] == best and event["restored_step"] == trainer.state.best_global_step
    saved = load_file(os.path.join(best, "model.safetensors"))
    live = dict(trainer.model.named_parameters())
    assert all(torch.equal(saved[name], live[name].detach()) for name in saved if name in live)
    assert weights_finite(trainer)


class DamageFrozenAtTheEnd(TrainerCallback):
    """Writes NaN into one frozen weight (a LoRA base layer) at `on_train_end`, after the guard's last check."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            first_frozen_matrix(model).view(-1)[0] = float("nan")


@pytest.mark.parametrize("load_best", [False, True], ids=["snapshot", "best_checkpoint"])
def test_a_frozen_base_damaged_at_the_end_is_repaired_whatever_is_put_back(toy_models, tmp_path, load_best):
    # A LoRA run's best checkpoint holds the adapters only: loading it put the adapters back and left the damaged
    # base as it was, so `train()` returned NaN weights (and the `restore` event said the state was restored).
    best = {"eval_rows": 4, "eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True}
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=4, save_steps=2,
        trainer_kwargs={"peft_config": LoraConfig(target_modules=["q_proj", "v_proj"], r=4)},
        **(best if load_best else {}),
    )  # fmt: skip
    trainer.add_callback(DamageFrozenAtTheEnd())
    trainer.train()
    (event,) = [e for e in read_events(str(tmp_path)) if e["kind"] == "restore"]
    assert event["restored_from"] == (trainer.state.best_model_checkpoint if load_best else "snapshot")
    assert weights_finite(trainer)
