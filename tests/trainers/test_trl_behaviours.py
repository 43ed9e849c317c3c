"""The behaviours TRL's own SFT and RLOO trainer tests check, run against TRL's class and the safe class alike.

TRL's test files load tiny models and datasets from the Hugging Face Hub (`trl-internal-testing/...`), which these
tests cannot reach, so they are not run as such: each behaviour they check (every data format trains and moves the
weights, completion-only labels, packing, padding-free, a formatting function, PEFT trains only the adapter, the
evaluation loop, reward functions, weights and models, the KL reference model, several iterations per generation) is
written here against the tiny local models, parametrised over `trl.X` and `safe_trainers.X`: the TRL run shows the
test checks TRL's behaviour, the safe run that the safe class keeps it. The four older trainers are covered the same
way in `test_dropin.py`. Where a rule deliberately changes a setting, the README lists it ("Deliberate differences
from TRL"); these scenarios use safe settings, so none applies.

Runs are fp32 (`bf16=False`) with `logging_nan_inf_filter=False`, so no rule fires: bf16 autocast is slow on a CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from safe_trainers.configs import config_class
from safe_trainers.kinds import KINDS
from safe_trainers.trainers import trainer_class
from safe_trainers.testing.build import preset_args
from safe_trainers.testing.toy import dataset_for, rank_reward


IMPLS = ["trl", "safe"]


def classes(kind: str, impl: str) -> tuple[type, type]:
    row = KINDS[kind]
    return (row.trl_trainer, row.trl_config) if impl == "trl" else (trainer_class(kind), config_class(kind))


def config(kind, impl, tmp_path, **overrides):
    """The `"quick"` preset's config for `impl` (the trainers are built by hand: the same call must suit both)."""
    kwargs = preset_args(kind, tmp_path / impl, bf16=False, logging_nan_inf_filter=False, **overrides)
    return classes(kind, impl)[1](**kwargs)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train(trainer) -> list[float]:
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses), trainer.state.log_history
    return losses


def assert_every_parameter_moved(trainer) -> None:
    before = snapshot(trainer.model)
    train(trainer)
    still = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p.detach())]
    assert not still, f"parameters that did not change: {still}"


def assert_only_adapter_moved(trainer) -> None:
    assert isinstance(trainer.model, PeftModel)
    before = snapshot(trainer.model)
    train(trainer)
    for name, param in trainer.model.named_parameters():
        moved = not torch.equal(before[name], param.detach())
        if "lora_B" in name:
            assert moved, f"{name} should train"
        elif "lora_" not in name:
            assert not moved, f"base parameter {name} should stay frozen"


def length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c if isinstance(c, str) else c[0]["content"])) / 10 for c in completions]


# --------------------------------------------------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------------------------------------------------


def _conversational(rows: Dataset) -> Dataset:
    return Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
            for r in rows
        ]
    )


SFT_DATASETS = {
    "language_modeling": lambda: Dataset.from_list(
        [{"text": r["prompt"] + r["completion"]} for r in dataset_for("sft", 8)]
    ),
    "conversational_language_modeling": lambda: _conversational(dataset_for("sft", 8)),
    "prompt_completion": lambda: dataset_for("sft", 8),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("data", list(SFT_DATASETS))
def test_sft_trains_every_format(data, impl, toy_models, tmp_path):
    trainer_class, _ = classes("sft", impl)
    trainer = trainer_class(
        toy_models["qwen2"], args=config("sft", impl, tmp_path), train_dataset=SFT_DATASETS[data]()
    )
    assert_every_parameter_moved(trainer)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("completion_only_loss", [None, False])
def test_sft_completion_only_labels(completion_only_loss, impl, toy_models, tmp_path):
    trainer_class, _ = classes("sft", impl)
    args = config("sft", impl, tmp_path, completion_only_loss=completion_only_loss)
    trainer = trainer_class(toy_models["qwen2"], args=args, train_dataset=dataset_for("sft", 4))
    row = trainer.train_dataset[0]
    if completion_only_loss is None:  # the default for prompt-completion data: only the completion is trained on
        assert row["labels"][0] == -100 and row["labels"][-1] == row["input_ids"][-1]
        assert -100 in row["labels"] and any(label != -100 for label in row["labels"])
    else:
        assert row["labels"] == row["input_ids"]


@pytest.mark.parametrize("impl", IMPLS)
def test_sft_packing_and_truncation(impl, toy_models, tmp_path):
    trainer_class, _ = classes("sft", impl)
    packed = trainer_class(
        toy_models["qwen2"],
        args=config("sft", impl, tmp_path, packing=True, max_length=32),
        train_dataset=dataset_for("sft", 8),
    )
    assert len(packed.train_dataset) < 8 and "seq_lengths" in packed.train_dataset.column_names
    assert all(len(ids) <= 32 for ids in packed.train_dataset["input_ids"])
    assert_every_parameter_moved(packed)
    truncated = trainer_class(
        toy_models["qwen2"], args=config("sft", impl, tmp_path, max_length=8), train_dataset=dataset_for("sft", 8)
    )
    assert max(len(ids) for ids in truncated.train_dataset["input_ids"]) == 8


@pytest.mark.parametrize("impl", IMPLS)
def test_sft_padding_free_and_formatting_func(impl, toy_models, tmp_path):
    trainer_class, _ = classes("sft", impl)
    args = config("sft", impl, tmp_path, padding_free=True, max_length=None)
    qa = Dataset.from_list([{"question": r["prompt"], "answer": r["completion"]} for r in dataset_for("sft", 8)])
    trainer = trainer_class(
        toy_models["qwen2"],
        args=args,
        train_dataset=qa,
        formatting_func=lambda row: f"question: {row['question']} answer: {row['answer']}",
    )
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # flattened, no padding
    assert_every_parameter_moved(trainer)


@pytest.mark.parametrize("impl", IMPLS)
def test_sft_peft_trains_only_the_adapter(impl, toy_models, tmp_path):
    trainer_class, _ = classes("sft", impl)
    lora = LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8)
    trainer = trainer_class(
        toy_models["qwen2"], args=config("sft", impl, tmp_path), train_dataset=dataset_for("sft", 8), peft_config=lora
    )
    assert_only_adapter_moved(trainer)


@pytest.mark.parametrize("impl", IMPLS)
def test_sft_model_instance_and_eval_dataset(impl, toy_models, tmp_path):
    trainer_class, _ = classes("sft", impl)
    model = AutoModelForCausalLM.from_pretrained(toy_models["llama"])
    tokenizer = AutoTokenizer.from_pretrained(toy_models["llama"])
    args = config("sft", impl, tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    trainer = trainer_class(
        model,
        args=args,
        train_dataset=dataset_for("sft", 8),
        eval_dataset=dataset_for("sft", 4, seed=1),
        processing_class=tokenizer,
    )
    assert trainer.model is model and trainer.processing_class is tokenizer
    assert_every_parameter_moved(trainer)
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert evals and math.isfinite(evals[-1]["eval_loss"]) and "eval_mean_token_accuracy" in evals[-1]


# --------------------------------------------------------------------------------------------------------------------
# RLOO
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_rloo_trains_standard_and_conversational_prompts(conversational, impl, toy_models, tmp_path):
    trainer_class, _ = classes("rloo", impl)
    data = dataset_for("rloo", 8)
    if conversational:
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in data])
    trainer = trainer_class(
        toy_models["qwen2"], reward_funcs=rank_reward, args=config("rloo", impl, tmp_path), train_dataset=data
    )
    assert trainer.ref_model is not None  # `beta=0.05` by default: a frozen reference model for the KL penalty
    assert_every_parameter_moved(trainer)
    assert any("kl" in entry for entry in trainer.state.log_history)


@pytest.mark.parametrize("impl", IMPLS)
def test_rloo_reward_functions_weights_and_reward_model(impl, toy_models, tmp_path):
    trainer_class, _ = classes("rloo", impl)
    args = config("rloo", impl, tmp_path, reward_weights=[1.0, 0.5, 0.1], beta=0.0)
    trainer = trainer_class(
        toy_models["qwen2"],
        reward_funcs=[rank_reward, length_reward, toy_models["qwen2-rm"]],
        args=args,
        train_dataset=dataset_for("rloo", 8),
    )
    assert trainer.ref_model is None  # `beta=0.0`: no reference model
    assert_every_parameter_moved(trainer)
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"rewards/rank_reward/mean", "rewards/length_reward/mean"} <= logged
    assert any(key.startswith("rewards/") and "qwen2-rm" in key for key in logged), logged


@pytest.mark.parametrize("impl", IMPLS)
def test_rloo_iterations_clipping_and_normalisation(impl, toy_models, tmp_path):
    trainer_class, _ = classes("rloo", impl)
    args = config(
        "rloo", impl, tmp_path, num_iterations=2, normalize_advantages=True, reward_clip_range=(-1.0, 2.0), beta=0.0
    )
    trainer = trainer_class(
        toy_models["qwen2"], reward_funcs=rank_reward, args=args, train_dataset=dataset_for("rloo", 8)
    )
    assert_every_parameter_moved(trainer)


@pytest.mark.parametrize("impl", IMPLS)
def test_rloo_peft_trains_only_the_adapter(impl, toy_models, tmp_path):
    trainer_class, _ = classes("rloo", impl)
    lora = LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8)
    trainer = trainer_class(
        toy_models["qwen2"],
        reward_funcs=rank_reward,
        args=config("rloo", impl, tmp_path),
        train_dataset=dataset_for("rloo", 8),
        peft_config=lora,
    )
    assert trainer.ref_model is None  # with PEFT the reference model is the base model, adapter disabled
    assert_only_adapter_moved(trainer)


@pytest.mark.parametrize("impl", IMPLS)
def test_rloo_eval_dataset(impl, toy_models, tmp_path):
    trainer_class, _ = classes("rloo", impl)
    args = config("rloo", impl, tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2, beta=0.0)
    trainer = trainer_class(
        toy_models["qwen2"],
        reward_funcs=rank_reward,
        args=args,
        train_dataset=dataset_for("rloo", 8),
        eval_dataset=dataset_for("rloo", 4, seed=1),
    )
    train(trainer)
    evals = [entry for entry in trainer.state.log_history if "eval_reward" in entry]
    assert evals and math.isfinite(evals[-1]["eval_reward"])


@pytest.mark.parametrize("impl", IMPLS)
def test_rloo_single_generation_is_refused(impl, tmp_path):
    # TRL refuses it in its config; the safe config refuses it first, with the rule's message (still a ValueError)
    _, config_class = classes("rloo", impl)
    with pytest.raises(ValueError, match="2 generations|`num_generations=1`"):
        config_class(**preset_args("rloo", tmp_path, num_generations=1))
