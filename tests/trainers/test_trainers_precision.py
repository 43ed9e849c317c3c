"""Precision misses, on real trainers: fp16 chosen by accelerate, fp16 model instances (the frozen LoRA base, the
reference model TRL builds from the policy's dtype), and a LoRA reward model whose checkpoint is stored in fp16."""

from __future__ import annotations

import math

import pytest
import torch
import trl
from packaging.version import Version
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.toy import build_model, build_tokenizer

from trainer_utils import actions, train_losses  # tests/ is on sys.path, as for conftest


def dtypes(model) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


@pytest.fixture(scope="module")
def gemma2_rm_fp16(tmp_path_factory) -> str:
    """A Gemma-2 reward checkpoint stored in fp16 (`config.json` says `"dtype": "float16"`)."""
    path = str(tmp_path_factory.mktemp("gemma2-rm-fp16"))
    build_model("gemma2", "seq_cls").to(torch.float16).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------------------------
# fp16 chosen through accelerate (`accelerate launch --mixed_precision fp16`, its config file, the environment)
# --------------------------------------------------------------------------------------------------------------------


def test_accelerate_fp16_is_switched_to_bf16(toy_models, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    trainer = build_trainer("dpo", toy_models["gemma2"], tmp_path, bf16=False)
    (finding,) = trainer.safety_report.by_rule("precision.bf16_over_fp16")
    assert finding.action == "fixed" and "accelerate's `mixed_precision='fp16'`" in finding.message
    assert trainer.accelerator.mixed_precision == "bf16"  # what the trainer actually trains in
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_accelerate_fp16_trains_in_fp16_without_the_rule(toy_models, tmp_path, monkeypatch):
    # the control: with the rule off the trainer trains in fp16 although `fp16=False`
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    trainer = build_trainer(
        "dpo", toy_models["gemma2"], tmp_path, bf16=False, safety_disable_rules=["precision.bf16_over_fp16"]
    )
    assert (trainer.args.fp16, trainer.accelerator.mixed_precision) == (False, "fp16")


# --------------------------------------------------------------------------------------------------------------------
# A model instance already in fp16
# --------------------------------------------------------------------------------------------------------------------


def test_fp16_instance_with_lora_has_no_fp16_base(toy_models, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(toy_models["gemma2"], dtype=torch.float16)
    lora = LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"], r=4)
    trainer = build_trainer("dpo", model, tmp_path, learning_rate=1e-5, trainer_kwargs={"peft_config": lora})
    (finding,) = trainer.safety_report.by_rule("precision.bf16_over_fp16")
    assert finding.action == "fixed" and "the model passed in has fp16 weights" in finding.message
    assert torch.float16 not in dtypes(trainer.model)  # the frozen base was fp16 and stayed fp16
    assert {p.dtype for p in trainer.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_fp16_instance_full_finetune_reference_model_is_not_fp16(toy_models, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(toy_models["gemma2"], dtype=torch.float16)
    trainer = build_trainer("dpo", model, tmp_path, learning_rate=1e-6)
    assert actions(trainer)["precision.bf16_over_fp16"] == "fixed"
    # TRL builds the reference model from the policy's dtype at construction, before any later upcast (TRL 1.14
    # loads it from the path with `model_init_kwargs`, float32 by default)
    built_like_the_policy = Version(trl.__version__) >= Version("1.16")
    expected = {torch.bfloat16} if built_like_the_policy else {torch.float32}
    assert trainer.ref_model is not None and dtypes(trainer.ref_model) == expected
    assert torch.float16 not in dtypes(trainer.model)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


# --------------------------------------------------------------------------------------------------------------------
# LoRA reward model of an fp16-unsafe family whose checkpoint is stored in fp16
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a process of its own, or a real run
def test_reward_lora_fp16_checkpoint_is_not_reloaded_in_fp16(gemma2_rm_fp16, tmp_path):
    lora = LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"], r=4)
    trainer = build_trainer(
        "reward",
        gemma2_rm_fp16,
        tmp_path,
        model_init_kwargs={"dtype": "float16"},
        trainer_kwargs={"peft_config": lora},
    )
    (finding,) = trainer.safety_report.by_rule("precision.bf16_over_fp16")
    assert finding.action == "fixed" and "`gemma2` activations overflow" in finding.message
    assert trainer.args.model_init_kwargs == {"dtype": "bfloat16"}
    assert torch.float16 not in dtypes(trainer.model)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_reward_lora_fp32_checkpoint_still_loads_auto(toy_models, tmp_path):
    # the not-firing side: an fp32 checkpoint, where `dtype="auto"` loads fp32
    lora = LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"], r=4)
    trainer = build_trainer(
        "reward",
        toy_models["gemma2-rm"],
        tmp_path,
        rows=4,
        model_init_kwargs={"dtype": "float16"},
        trainer_kwargs={"peft_config": lora},
    )
    assert trainer.args.model_init_kwargs == {"dtype": "auto"}
    assert "precision.bf16_over_fp16" not in actions(trainer)
    assert dtypes(trainer.model) == {torch.float32}
