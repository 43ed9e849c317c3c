"""`safe_trainers.SFTTrainer` on tiny models, on CPU: each rule that applies to SFT firing and staying quiet, with
real training. The rules shared by every trainer (clipping, logging, bf16 on a plain model) are also covered by the
parametrised trainer tests in `tests/rules/` (`test_optim_rules.py`, `test_precision_rules.py`); the fault matrix is
in `test_faults_on_each_trainer.py`.
"""

from __future__ import annotations

import math

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from safe_trainers import SafetyError
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.toy import dataset_for
from trainer_utils import actions, check_gemma2_sdpa_without_the_rule, snapshot, train_losses  # tests/ on sys.path


LONG_PROMPT = " ".join(["one two three four five six seven eight nine ten"] * 4)  # > 16 tokens


# --------------------------------------------------------------------------------------------------------------------
# precision.bf16_over_fp16, attention.gemma2_no_flash, precision.fp32_trainable_params
# --------------------------------------------------------------------------------------------------------------------


def test_fp16_on_gemma2_becomes_bf16_and_trains(toy_models, tmp_path):
    trainer = build_trainer("sft", toy_models["gemma2"], tmp_path, fp16=True)
    assert (trainer.args.fp16, trainer.args.bf16) == (False, True)
    (finding,) = trainer.safety_report.by_rule("precision.bf16_over_fp16")
    assert finding.action == "fixed" and "`gemma2` activations overflow" in finding.message
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_gemma2_sdpa_becomes_eager_and_trains(toy_models, tmp_path):
    trainer = build_trainer("sft", toy_models["gemma2"], tmp_path, model_init_kwargs={"attn_implementation": "sdpa"})
    assert trainer.model.config._attn_implementation == "eager"
    assert actions(trainer)["attention.gemma2_no_flash"] == "fixed"
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_gemma2_sdpa_without_the_rule(toy_models, tmp_path):
    check_gemma2_sdpa_without_the_rule("sft", toy_models["gemma2"], tmp_path)


def _fp16_lora_model(path):
    """A PEFT model whose LoRA weights stay fp16, as PEFT leaves them with `autocast_adapter_dtype=False` (what TRL
    passes under ZeRO-3) on an fp16 base."""
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    lora = LoraConfig(target_modules=["q_proj", "v_proj"], r=4, task_type="CAUSAL_LM")
    return get_peft_model(base, lora, autocast_adapter_dtype=False)


def test_fp16_lora_adapter_upcast_to_fp32_and_trains(toy_models, tmp_path):
    # With bf16 at hand `precision.bf16_over_fp16` casts fp16 weights to bf16 first; without it (V100/T4, or the rule
    # disabled as here) the fp16 adapter is what `precision.fp32_trainable_params` fixes.
    trainer = build_trainer(
        "sft", _fp16_lora_model(toy_models["qwen2"]), tmp_path, safety_disable_rules=["precision.bf16_over_fp16"]
    )
    (finding,) = trainer.safety_report.by_rule("precision.fp32_trainable_params")
    assert finding.action == "fixed" and all("lora_" in name for name in finding.data["names"])
    trainable = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and set(trainable.values()) == {torch.float32}
    frozen = {p.dtype for p in trainer.model.parameters() if not p.requires_grad}
    assert frozen == {torch.float16}  # only the trained parameters are upcast
    before = snapshot(trainer.model)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_fp16_lora_adapter_left_fp16_without_the_rule(toy_models, tmp_path):
    trainer = build_trainer(
        "sft",
        _fp16_lora_model(toy_models["qwen2"]),
        tmp_path,
        safety_disable_rules=["precision.fp32_trainable_params", "precision.bf16_over_fp16"],
    )
    assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {torch.float16}


def test_fp32_lora_not_touched(toy_models, tmp_path):
    lora = LoraConfig(target_modules=["q_proj", "v_proj"], r=4, task_type="CAUSAL_LM")
    trainer = build_trainer(
        "sft",
        toy_models["qwen2"],
        tmp_path,
        rows=4,
        trainer_kwargs={"peft_config": lora},
        logging_nan_inf_filter=False,
    )
    assert trainer.safety_report.findings == []


# --------------------------------------------------------------------------------------------------------------------
# data.no_loss_tokens: examples with no token to train on
# --------------------------------------------------------------------------------------------------------------------


def _texts(good: int, empty: int) -> Dataset:
    return Dataset.from_list([{"text": "the cat is good and the dog is bad"}] * good + [{"text": ""}] * empty)


def test_empty_texts_dropped_and_counted(toy_models, tmp_path):
    # An empty text becomes EOS alone: one token, whose label the causal loss never scores. TRL keeps it.
    trainer = build_trainer("sft", toy_models["qwen2"], tmp_path, dataset=_texts(good=5, empty=3))
    assert len(trainer.train_dataset) == 5
    (finding,) = trainer.safety_report.by_rule("data.no_loss_tokens")
    assert finding.action == "fixed" and "3 of 8 training examples have no token to train on" in finding.message
    assert [(c.path, c.old, c.new) for c in finding.changes] == [("train_dataset.num_rows", 8, 5)]
    assert all(len(row["input_ids"]) > 1 for row in trainer.train_dataset)
    assert all(math.isfinite(loss) and loss > 0 for loss in train_losses(trainer))


def test_empty_texts_train_on_nothing_without_the_rule(toy_models, tmp_path):
    # the control (trl#6668): TRL trains on them and logs a loss of 0.0 (NaN, 0 / 0 tokens, with TRL 1.14 on recent
    # transformers releases), the weights do not move
    trainer = build_trainer(
        "sft",
        toy_models["qwen2"],
        tmp_path,
        dataset=_texts(good=0, empty=4),
        safety_disable_rules=["data.no_loss_tokens"],
    )
    assert len(trainer.train_dataset) == 4
    before = snapshot(trainer.model)
    losses = train_losses(trainer)
    assert len(losses) == 2 and all(loss == 0.0 or math.isnan(loss) for loss in losses)
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_only_empty_texts_refused(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\[data.no_loss_tokens\] all 4 training examples have no token to train"):
        build_trainer("sft", toy_models["qwen2"], tmp_path, dataset=_texts(good=0, empty=4))


def _long_prompts(n=8, long=(0, 1, 2)) -> Dataset:
    rows = dataset_for("sft", n).to_list()
    for i in long:
        rows[i]["prompt"] = LONG_PROMPT
    return Dataset.from_list(rows)


def test_prompts_filling_max_length_counted(toy_models, tmp_path):
    # TRL drops these itself, silently; the report counts them
    trainer = build_trainer("sft", toy_models["qwen2"], tmp_path, dataset=_long_prompts(), max_length=16)
    assert len(trainer.train_dataset) == 5
    (finding,) = trainer.safety_report.by_rule("data.no_loss_tokens")
    assert finding.action == "warned" and "3 of 8 training examples were dropped by TRL's preprocessing" in (
        finding.message
    )
    assert "`max_length=16`" in finding.message
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_all_prompts_filling_max_length_refused(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\[data.no_loss_tokens\] all 4 training examples were dropped"):
        build_trainer("sft", toy_models["qwen2"], tmp_path, dataset=_long_prompts(4, long=range(4)), max_length=16)


def _pretokenized(n=8, masked=(1, 4)) -> Dataset:
    """Tokenized prompt-completion rows; the rows in `masked` have an all-zero completion mask."""
    rows = []
    for i in range(n):
        mask = [0, 0, 0, 0, 0] if i in masked else [0, 0, 1, 1, 1]
        rows.append({"input_ids": [5, 6, 7, 8, 1], "completion_mask": mask})
    return Dataset.from_list(rows)


def test_completion_only_masked_rows_without_max_length_dropped(toy_models, tmp_path):
    # With `max_length=None`, TRL drops nothing: these rows would reach the loss with zero tokens
    data = _pretokenized()
    trainer = build_trainer(
        "sft", toy_models["qwen2"], tmp_path, dataset=data, max_length=None, completion_only_loss=True
    )
    assert len(trainer.train_dataset) == 6
    (finding,) = trainer.safety_report.by_rule("data.no_loss_tokens")
    assert finding.action == "fixed" and "2 of 8" in finding.message and "(first: row 1)" in finding.message
    assert "`completion_only_loss`" in finding.message
    assert all(math.isfinite(loss) and loss > 0 for loss in train_losses(trainer))

    control = build_trainer(
        "sft",
        toy_models["qwen2"],
        tmp_path / "trl",
        dataset=data,
        trainer_cls=trl.SFTTrainer,
        config_cls=trl.SFTConfig,
        max_length=None,
        completion_only_loss=True,
    )
    assert len(control.train_dataset) == 8


ASSISTANT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %} {% endfor %}"
)


def test_assistant_only_loss_truncated_turns_counted(toy_models, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy_models["qwen2"])
    tokenizer.chat_template = ASSISTANT_TEMPLATE
    rows = [
        [
            {"role": "user", "content": LONG_PROMPT if i < 2 else "what is good"},
            {"role": "assistant", "content": "yes"},
        ]
        for i in range(6)
    ]
    trainer = build_trainer(
        "sft",
        toy_models["qwen2"],
        tmp_path,
        dataset=Dataset.from_list([{"messages": m} for m in rows]),
        trainer_kwargs={"processing_class": tokenizer},
        assistant_only_loss=True,
        max_length=16,
    )
    assert len(trainer.train_dataset) == 4
    (finding,) = trainer.safety_report.by_rule("data.no_loss_tokens")
    assert "2 of 6" in finding.message and "`assistant_only_loss`" in finding.message
    assert all(math.isfinite(loss) for loss in train_losses(trainer))
