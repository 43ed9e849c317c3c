"""Real construction and training of the six safe trainers on tiny models, on CPU.

Every test builds a real TRL trainer from a tiny model saved on disk (see `conftest.toy_models`), and trains for two
steps where training is part of the claim. What one rule does on a real trainer lives with that rule's tests, in
`tests/rules/`; here: training, the safety modes, disabled rules, the report file, plain TRL configs.
"""

from __future__ import annotations

import math
import os

import pytest
import trl

from safe_trainers import (
    DPOConfig,
    DPOTrainer,
    GRPOTrainer,
    SafetyError,
)
from safe_trainers.kinds import KINDS, TRAINER_KINDS
from safe_trainers.testing.build import build_trainer, preset_args
from safe_trainers.testing.toy import dataset_for, rank_reward

from trainer_utils import (  # tests/ is on sys.path, as for conftest
    CONFIGS, DEFAULT_MODEL, TRAINERS, actions, changed, read_report, snapshot,
    train_losses,
)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# Each trainer trains and changes the weights
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_trainer_trains_and_changes_weights(kind, toy_models, tmp_path):
    trainer = build_trainer(kind, toy_models[DEFAULT_MODEL[kind]], tmp_path)
    assert isinstance(trainer, getattr(trl, type(trainer).__name__))
    before = snapshot(trainer.model)
    losses = train_losses(trainer)
    assert all(math.isfinite(loss) for loss in losses)
    assert trainer.state.global_step == 2
    moved = changed(before, trainer.model)
    # every parameter of a tiny model gets a gradient in two steps
    assert sorted(moved) == sorted(before), set(before) - set(moved)
    assert trainer.safety_report.trainer == kind and trainer.safety_report.mode == "fix"


# --------------------------------------------------------------------------------------------------------------------
# Modes, disabled rules, report file, plain TRL configs, args=None
# --------------------------------------------------------------------------------------------------------------------


def _unsafe_gemma_config(tmp_path, **overrides):
    return preset_args(
        "dpo",
        tmp_path / "out",
        fp16=True,
        max_grad_norm=0.0,
        model_init_kwargs={"attn_implementation": "sdpa"},
        **overrides,
    )


def test_strict_mode_raises_one_error_with_every_finding(toy_models, tmp_path):
    args = DPOConfig(**_unsafe_gemma_config(tmp_path, safety_mode="strict"))
    with pytest.raises(SafetyError, match=r"refused this configuration \(3 problems\)") as exc:
        DPOTrainer(model=toy_models["gemma2"], args=args, train_dataset=dataset_for("dpo", 4))
    # TRL's default `logging_nan_inf_filter=True` is not a problem of this config: it does not fail `strict`.
    expected = ["precision.bf16_over_fp16", "attention.gemma2_no_flash", "optim.grad_clip"]
    assert [f.rule_id for f in exc.value.findings] == expected
    for rule_id in expected:
        assert f"[{rule_id}]" in str(exc.value)
    assert not os.path.exists(args.output_dir)


def test_strict_mode_passes_a_safe_config(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, rows=4, safety_mode="strict", logging_nan_inf_filter=False
    )
    assert trainer.safety_report.findings == [] and trainer.safety_report.mode == "strict"


def test_fix_mode_applies_everything_and_writes_the_report(toy_models, tmp_path):
    args = DPOConfig(**_unsafe_gemma_config(tmp_path))
    trainer = DPOTrainer(model=toy_models["gemma2"], args=args, train_dataset=dataset_for("dpo", 8))
    a = trainer.args
    assert (a.fp16, a.bf16, a.max_grad_norm, a.logging_nan_inf_filter) == (False, True, 1.0, False)
    assert trainer.model.config._attn_implementation == "eager"
    assert (args.fp16, args.max_grad_norm, args.model_init_kwargs) == (True, 0.0, {"attn_implementation": "sdpa"})
    data = read_report(trainer)
    assert data["trainer"] == "dpo" and data["mode"] == "fix"
    assert [(f["rule_id"], f["action"]) for f in data["findings"]] == [
        ("precision.bf16_over_fp16", "fixed"),
        ("attention.gemma2_no_flash", "fixed"),
        ("optim.grad_clip", "fixed"),
        ("logging.show_nonfinite", "fixed"),
    ]
    clip = data["findings"][2]
    assert clip["changes"] == [{"path": "args.max_grad_norm", "old": 0.0, "new": 1.0}]
    assert data == trainer.safety_report.to_dict()


def test_warn_mode_changes_nothing(toy_models, tmp_path):
    args = DPOConfig(**preset_args("dpo", tmp_path / "out", fp16=True, max_grad_norm=0.0, safety_mode="warn"))
    trainer = DPOTrainer(model=toy_models["gemma2"], args=args, train_dataset=dataset_for("dpo", 4))
    a = trainer.args
    assert a is args
    assert (a.fp16, a.bf16, a.max_grad_norm, a.logging_nan_inf_filter) == (True, False, 0.0, True)
    assert actions(trainer) == {
        "precision.bf16_over_fp16": "warned",
        "optim.grad_clip": "warned",
        "logging.show_nonfinite": "warned",
    }
    assert trainer.safety_report.changes == []
    assert {f["action"] for f in read_report(trainer)["findings"]} == {"warned"}


def test_warn_mode_still_refuses_blocked_findings(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\[dpo.beta_positive\]"):
        build_trainer("dpo", toy_models["qwen2"], tmp_path, beta=0.0, loss_type="ipo", safety_mode="warn")


def test_off_mode_runs_no_rule(toy_models, tmp_path):
    trainer = build_trainer("kto", toy_models["qwen2"], tmp_path, rows=4, max_grad_norm=0.0, safety_mode="off")
    assert trainer.args.max_grad_norm == 0.0 and trainer.args.logging_nan_inf_filter is True
    assert trainer.safety_report.findings == []
    assert read_report(trainer) == {"trainer": "kto", "mode": "off", "findings": []}
    assert "safety rules are off" in trainer.safety_report.render()


def test_off_mode_lets_trl_see_blocked_settings(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, rows=4, beta=0.0, safety_mode="off")
    assert trainer.args.beta == 0.0


def test_disabled_rules_left_alone(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo",
        toy_models["gemma2"],
        tmp_path,
        rows=4,
        fp16=True,
        max_grad_norm=0.0,
        safety_disable_rules=["optim.grad_clip", "precision.bf16_over_fp16"],
    )
    assert trainer.args.max_grad_norm == 0.0 and trainer.args.fp16 is True
    assert trainer.args.logging_nan_inf_filter is False  # the other rules still run
    assert actions(trainer) == {
        "precision.bf16_over_fp16": "skipped",
        "optim.grad_clip": "skipped",
        "logging.show_nonfinite": "fixed",
    }
    skipped = [f for f in read_report(trainer)["findings"] if f["action"] == "skipped"]
    assert {f["rule_id"] for f in skipped} == {"optim.grad_clip", "precision.bf16_over_fp16"}


def test_plain_trl_config_gets_default_safety(toy_models, tmp_path):
    args = trl.DPOConfig(**preset_args("dpo", tmp_path / "out", max_grad_norm=0.0))
    trainer = DPOTrainer(model=toy_models["qwen2"], args=args, train_dataset=dataset_for("dpo", 8))
    assert type(trainer.args) is trl.DPOConfig
    assert trainer.args.max_grad_norm == 1.0 and args.max_grad_norm == 0.0
    assert trainer.safety_report.mode == "fix"
    assert trainer.safety_settings.safety_disable_rules == []
    assert os.path.isfile(os.path.join(args.output_dir, "safety_report.json"))
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_plain_trl_grpo_config_is_checked(config_only_model, tmp_path):
    args = trl.GRPOConfig(**preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4))
    args.num_generations = 1
    with pytest.raises(SafetyError, match="`num_generations=1`"):
        GRPOTrainer(model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4))


def test_plain_trl_grpo_config_checked_when_no_other_fix_applies(config_only_model, tmp_path):
    # the same mutated config as above, but with nothing for an earlier rule to fix: grpo.group_size speaks
    args = trl.GRPOConfig(
        **preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4, logging_nan_inf_filter=False)
    )
    args.num_generations = 1
    with pytest.raises(SafetyError, match="`num_generations=1`"):
        GRPOTrainer(model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4))


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_args_none_raises_what_trl_raises(kind, toy_models, tmp_path, monkeypatch):
    # With no config, TRL builds a default one (bf16=True); transformers refuses bf16 on a CPU-only machine
    # without `use_cpu`. Whatever TRL raises here, the safe trainer must raise the same.
    monkeypatch.chdir(tmp_path)
    extra = {"reward_funcs": rank_reward} if KINDS[kind].online else {}
    model = toy_models[DEFAULT_MODEL[kind]]
    trl_class = getattr(trl, TRAINERS[kind].__name__)
    try:
        trl_class(model, train_dataset=dataset_for(kind, 4), **extra)
    except Exception as e:  # noqa: BLE001 - we compare with whatever TRL does
        expected = e
    else:
        pytest.skip("this machine accepts TRL's default config; covered by the next test")
    with pytest.raises(type(expected)) as exc:
        TRAINERS[kind](model, train_dataset=dataset_for(kind, 4), **extra)
    assert type(exc.value) is type(expected) and str(exc.value) == str(expected)


@pytest.mark.parametrize("kind, suffix", [("dpo", "DPO"), ("reward", "Reward"), ("sft", "SFT")])
def test_args_none_default_config_named_after_model(kind, suffix, toy_models, tmp_path, monkeypatch):
    # pretend bf16 is available so that the default config can be built on this CPU-only machine
    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    model = toy_models[DEFAULT_MODEL[kind]]
    trl_trainer = getattr(trl, TRAINERS[kind].__name__)(model, train_dataset=dataset_for(kind, 4))
    trainer = TRAINERS[kind](model, train_dataset=dataset_for(kind, 4))
    expected_dir = f"{os.path.basename(model)}-{suffix}"
    assert trl_trainer.args.output_dir == trainer.args.output_dir == expected_dir
    assert isinstance(trainer.args, CONFIGS[kind])
    assert trainer.args.bf16 == trl_trainer.args.bf16
    assert os.path.isfile(tmp_path / expected_dir / "safety_report.json")
