"""The optimizer and logging rules: `optim.grad_clip` (no clipping, or an unusual `max_grad_norm`),
`optim.learning_rate` (full fine-tuning above 1e-5) and `logging.show_nonfinite` (NaN losses hidden in the logs)."""

from __future__ import annotations

import math

import pytest
from peft import LoraConfig, get_peft_model

from safe_trainers import GRPOConfig
from safe_trainers.rules import get_rule
from safe_trainers.rules.optim import clipping_disabled
from safe_trainers.rules.report import Change
from safe_trainers.testing.toy import build_model

from rule_utils import make_args, make_setup, run_setup_stage  # tests/ is on sys.path, as for conftest
from trainer_utils import DEFAULT_MODEL, actions, train_losses  # tests/ is on sys.path, as for conftest
from safe_trainers.kinds import TRAINER_KINDS
from safe_trainers.testing.build import build_trainer
import torch


GRAD_CLIP = get_rule("optim.grad_clip")
LEARNING_RATE = get_rule("optim.learning_rate")


# --------------------------------------------------------------------------------------------------------------------
# optim.grad_clip and logging.show_nonfinite
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, -1.0, None, math.inf, math.nan])
def test_grad_clip_disabled_becomes_one(value):
    args = make_args("dpo")
    args.max_grad_norm = value  # some values are not accepted by the constructor; set it as a launcher could
    finding = GRAD_CLIP.check(make_setup("dpo", args=args))
    assert finding.action == "fixed"
    (change,) = finding.changes
    assert change.path == "args.max_grad_norm" and change.new == 1.0
    assert "disables gradient clipping" in finding.message
    assert clipping_disabled(value)


@pytest.mark.parametrize("value, hint", [(50.0, "almost never act"), (0.001, "barely move")])
def test_grad_clip_unusual_value_warned(value, hint):
    finding = GRAD_CLIP.check(make_setup("dpo", args=make_args("dpo", max_grad_norm=value)))
    assert finding.action == "warned" and finding.changes == ()
    assert hint in finding.message


@pytest.mark.parametrize("value", [1.0, 0.3, 10.0, 0.01])
def test_grad_clip_sane_values_silent(value):
    assert GRAD_CLIP.check(make_setup("dpo", args=make_args("dpo", max_grad_norm=value))) is None
    assert not clipping_disabled(value)


def test_clipping_disabled_rejects_non_numbers():
    assert clipping_disabled(True) and clipping_disabled("1.0")


def test_grad_clip_fix_applied():
    args = make_args("grpo", max_grad_norm=0.0)
    new, report = run_setup_stage(make_setup("grpo", "qwen2", args=args), disable=["logging.show_nonfinite"])
    assert new.args.max_grad_norm == 1.0 and args.max_grad_norm == 0.0
    assert isinstance(new.args, GRPOConfig)
    assert report.changes == [Change("args.max_grad_norm", 0.0, 1.0)]


@pytest.mark.parametrize("kind", ["reward", "dpo", "kto", "grpo"])
def test_show_nonfinite(kind):
    rule = get_rule("logging.show_nonfinite")
    finding = rule.check(make_setup(kind, "qwen2", args=make_args(kind)))
    assert finding.action == "fixed"
    assert finding.changes == (Change("args.logging_nan_inf_filter", True, False),)
    assert rule.check(make_setup(kind, "qwen2", args=make_args(kind, logging_nan_inf_filter=False))) is None


# --------------------------------------------------------------------------------------------------------------------
# optim.learning_rate
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo"])
def test_learning_rate_of_full_finetuning_warned(kind):
    finding = LEARNING_RATE.check(make_setup(kind, "qwen2", args=make_args(kind, learning_rate=1e-4)))
    assert finding.action == "warned" and "`learning_rate=0.0001` while training every weight" in finding.message


@pytest.mark.parametrize(
    "kind, lr, lora",
    [("dpo", 1e-6, False), ("dpo", 1e-5, False), ("dpo", 1e-4, True), ("grpo", 5e-6, False), ("reward", 1e-4, False)],
)
def test_learning_rate_silent(kind, lr, lora):
    peft_config = LoraConfig(target_modules=["q_proj"]) if lora else None
    setup = make_setup(kind, "qwen2", args=make_args(kind, learning_rate=lr), peft_config=peft_config)
    assert LEARNING_RATE.check(setup) is None if kind in LEARNING_RATE.trainers else kind not in LEARNING_RATE.trainers


def test_learning_rate_silent_for_a_peft_model_instance():
    model = get_peft_model(build_model("qwen2"), LoraConfig(target_modules=["q_proj"], r=2))
    setup = make_setup("dpo", "qwen2", model=model, args=make_args("dpo", learning_rate=1e-4))
    assert LEARNING_RATE.check(setup) is None


# --------------------------------------------------------------------------------------------------------------------
# On a real safe trainer, built (and where the claim needs it, trained) from a tiny model
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_grad_clip_and_nonfinite_logging_fixed(kind, toy_models, tmp_path):
    trainer = build_trainer(kind, toy_models[DEFAULT_MODEL[kind]], tmp_path, rows=4, max_grad_norm=0.0)
    assert trainer.args.max_grad_norm == 1.0
    assert trainer.args.logging_nan_inf_filter is False
    assert actions(trainer)["optim.grad_clip"] == "fixed"
    assert actions(trainer)["logging.show_nonfinite"] == "fixed"


@pytest.mark.parametrize("kind", ["reward", "grpo"])
def test_grad_clip_and_nonfinite_logging_quiet_when_set(kind, toy_models, tmp_path):
    trainer = build_trainer(
        kind, toy_models[DEFAULT_MODEL[kind]], tmp_path, rows=4, max_grad_norm=0.5, logging_nan_inf_filter=False
    )
    assert trainer.args.max_grad_norm == 0.5
    assert trainer.safety_report.findings == []
    assert trainer.safety_report.render().endswith("all safety rules passed, nothing changed.")


def test_grad_clip_fix_takes_effect_in_training(toy_models, tmp_path):
    trainer = build_trainer("reward", toy_models["qwen2-rm"], tmp_path, max_grad_norm=0.0, learning_rate=1e-6)
    trainer.create_optimizer()
    inner = trainer.optimizer
    original_step = inner.step
    seen = []

    def step(*args, **kwargs):  # the real step, recording the norm of the gradients the optimizer receives
        grads = [p.grad.norm() for group in inner.param_groups for p in group["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack(grads))))
        return original_step(*args, **kwargs)

    inner.step = step
    train_losses(trainer)
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(seen) == 2
    assert max(logged) > 1.0, logged  # the gradients needed clipping (the logged norm is taken before clipping)
    assert all(norm <= 1.0 + 1e-4 for norm in seen), seen
