"""The seed failures on real kernels, stock TRL next to the safe trainers, on tiny models built from configs.

1. Gemma-3 DPO in fp16 (trl#3236): stock `trl.DPOTrainer` logs NaN rewards and a loss of 0; the safe trainer trains
   in bf16, finite.
2. A LoRA reward model loaded in fp16, without `task_type="SEQ_CLS"` (trl#2367, peft#1522): the stock head stays
   frozen and random; the safe trainer trains the head, finite.
3. Gemma-2 with flash attention (OpenRLHF#528), sequences longer than the sliding window: needs `flash_attn`.

The stock side is asserted where its failure is deterministic (1, and the frozen head of 2) and recorded otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForSequenceClassification

import safe_trainers as st
from safe_trainers.guard import read_events
from safe_trainers.rules.attention import SOFTCAP_SAFE, flash_soft_caps
from safe_trainers.rules.hardware import package_version
from safe_trainers.rules.peft import head_parameters
from safe_trainers.testing.quick import quick_args
from safe_trainers.testing.toy import WORDS, build_model, build_tokenizer, preference_dataset

from gpu_utils import all_finite, logged, record, stock_outcome
from safe_trainers.testing.build import build_trainer
from trainer_utils import actions, train_losses


GAIN = 1e5  # above fp16's largest finite value, 65504; far inside bf16's and fp32's range


@pytest.fixture(scope="module")
def gemma3_large_activations(tmp_path_factory) -> str:
    """A tiny Gemma-3 whose residual stream leaves fp16's range, as the released Gemma checkpoints' activations do.

    A random initialisation keeps activations small, so the gain of each post-feed-forward norm is set to `GAIN`
    (Gemma's norms scale by `1 + weight`): the norm's output has an RMS of `GAIN`, so at least one element of it is
    at least `GAIN` in magnitude: Inf once cast to fp16 under fp16 autocast, then NaN in the next norm.
    """
    model = build_model("gemma3")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_feedforward_layernorm.weight.fill_(GAIN - 1.0)
    path = str(tmp_path_factory.mktemp("gemma3-large-activations"))
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------------------------
# 1. Gemma-3 DPO in fp16
# --------------------------------------------------------------------------------------------------------------------


def test_gemma3_dpo_fp16_stock_logs_nan_rewards_and_a_zero_loss(gemma3_large_activations, tmp_path):
    args = trl.DPOConfig(**quick_args(output_dir=str(tmp_path / "stock"), max_steps=4, fp16=True, learning_rate=1e-5))
    trainer = trl.DPOTrainer(gemma3_large_activations, args=args, train_dataset=preference_dataset(8))
    assert trainer.accelerator.mixed_precision == "fp16" and trainer.accelerator.scaler is not None
    trainer.train()
    # Every forward pass overflows: the loss is NaN, which `logging_nan_inf_filter` (on by default) logs as 0.0; the
    # loss scaler skips every update, so the run "trains" without learning anything.
    assert logged(trainer, "loss") == [0.0] * 4
    assert all(math.isnan(v) for v in logged(trainer, "rewards/chosen") + logged(trainer, "rewards/margins"))
    assert all(math.isnan(v) for v in logged(trainer, "grad_norm"))


def test_gemma3_dpo_fp16_safe_trains_finite_in_bf16(gemma3_large_activations, tmp_path):
    trainer = build_trainer("dpo", gemma3_large_activations, tmp_path, fp16=True, max_steps=4)
    assert actions(trainer)["precision.bf16_over_fp16"] == "fixed"
    assert (trainer.args.fp16, trainer.args.bf16, trainer.accelerator.mixed_precision) == (False, True, "bf16")
    assert all_finite(train_losses(trainer))
    assert all_finite(logged(trainer, "rewards/chosen") + logged(trainer, "grad_norm"))
    assert read_events(trainer.args.output_dir) == []  # no step needed the guard: the rule removed the cause
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


# --------------------------------------------------------------------------------------------------------------------
# 2. A LoRA reward model loaded in fp16, no `task_type="SEQ_CLS"`
# --------------------------------------------------------------------------------------------------------------------


REWARD_CLASSES = {"stock": (trl.RewardTrainer, trl.RewardConfig), "safe": (st.RewardTrainer, st.RewardConfig)}


def reward_run(impl: str, model_dir: str, tmp_path):
    """A LoRA reward model loaded in fp16, without `task_type`, trained with `fp16=True` by `impl`'s classes."""
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float16)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])  # no `task_type`
    trainer_class, config_class = REWARD_CLASSES[impl]
    args = config_class(**quick_args(output_dir=str(tmp_path / impl), max_steps=6, fp16=True, learning_rate=1e-4))
    return trainer_class(model, args=args, train_dataset=preference_dataset(12), peft_config=lora)


def test_lora_reward_model_in_fp16(toy_models, tmp_path, record_property):
    stock = reward_run("stock", toy_models["qwen2-rm"], tmp_path)
    head = head_parameters(stock.model)
    assert head and not any(head.values())  # deterministic: the random head stays frozen and is not saved
    record(record_property, "stock_lora_reward_fp16", stock_outcome(stock))

    safe = reward_run("safe", toy_models["qwen2-rm"], tmp_path)
    assert actions(safe)["peft.reward_seq_cls_lora"] == "fixed"
    assert actions(safe)["precision.bf16_over_fp16"] == "fixed"
    assert torch.float16 not in {p.dtype for p in safe.model.parameters()}
    head = {n: p.detach().clone() for n, p in safe.model.named_parameters() if p.requires_grad and "score" in n}
    assert head
    assert all_finite(train_losses(safe)) and all_finite(logged(safe, "grad_norm"))
    moved = [n for n, p in safe.model.named_parameters() if n in head and not torch.equal(head[n], p.detach())]
    assert moved  # the head learned
    assert read_events(safe.args.output_dir) == []


# --------------------------------------------------------------------------------------------------------------------
# 3. Gemma-2 with flash attention
# --------------------------------------------------------------------------------------------------------------------


def installed_flash_attn() -> str:
    try:
        import flash_attn
    except (ImportError, OSError) as error:  # not installed, or a build that does not match this torch
        pytest.skip(f"`flash_attn` does not import ({error}): the Gemma-2 flash-attention case needs it")
    return package_version("flash_attn") or flash_attn.__version__


def long_preference_dataset(n: int) -> Dataset:
    """Prompts of 72 words: the sequences are longer than the toy Gemma-2's sliding window (64 tokens)."""
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(72))
    row = {"prompt": prompt, "chosen": " yes good answer", "rejected": " no bad answer"}
    return Dataset.from_list([row] * n)


def test_gemma2_flash_attention(toy_models, tmp_path, record_property):
    version = installed_flash_attn()
    init = {"attn_implementation": "flash_attention_2", "dtype": "bfloat16"}
    data = long_preference_dataset(8)
    settings = dict(max_steps=4, bf16=True, learning_rate=1e-5, model_init_kwargs=init)
    args = trl.DPOConfig(**quick_args(output_dir=str(tmp_path / "stock"), **settings))
    stock = trl.DPOTrainer(toy_models["gemma2"], args=args, train_dataset=data)
    assert stock.model.config._attn_implementation == "flash_attention_2"
    assert min(len(ids) for ids in stock.train_dataset["prompt_ids"]) > stock.model.config.sliding_window
    record(record_property, "stock_gemma2_flash_attention", {"flash_attn": version, **stock_outcome(stock)})

    safe = build_trainer("dpo", toy_models["gemma2"], tmp_path, dataset=data, **{**settings, "model_init_kwargs": dict(init)})
    soft_caps = flash_soft_caps("flash_attention_2", version)
    expected = "flash_attention_2" if soft_caps else SOFTCAP_SAFE
    assert safe.model.config._attn_implementation == expected
    assert ("attention.gemma2_no_flash" in actions(safe)) == (not soft_caps)
    assert all_finite(train_losses(safe)) and all_finite(logged(safe, "grad_norm"))
    assert read_events(safe.args.output_dir) == []
