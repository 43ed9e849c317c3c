"""The catalogue rules on real trainers: a reward model padded with EOS, untrained special-token embeddings, and GRPO
sampling from a vocabulary padded past the tokenizer."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.toy import build_model, build_tokenizer, rank_reward, save_toy_model

from trainer_utils import actions, train_losses  # tests/ is on sys.path, as for conftest


def save_model(path: str, family: str = "qwen2", task: str = "causal_lm", tokenizer=None, zero_rows=(), **config) -> str:
    """A tiny model saved with `tokenizer` (default: the toy one) and the embedding rows `zero_rows` set to 0."""
    model = build_model(family, task, **config)
    with torch.no_grad():
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):
            if module is not None:
                module.weight[list(zero_rows)] = 0.0
    model.save_pretrained(path)
    (tokenizer or build_tokenizer()).save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------------------------
# tokens.reward_pad_token
# --------------------------------------------------------------------------------------------------------------------


def last_non_pad_positions(trainer) -> list[int]:
    """Where the sequence-classification head reads the reward for a collated batch (transformers' rule)."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    ids = batch["input_ids"]
    non_pad = (ids != trainer.model.config.pad_token_id).int()
    return (torch.arange(ids.shape[1]) * non_pad).argmax(-1).tolist()


def eos_positions(trainer) -> list[int]:
    """The position of the EOS that TRL appends to each text (the last token before the right padding)."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    eos = trainer.processing_class.eos_token_id
    last = (batch["attention_mask"].sum(-1) - 1).tolist()
    assert all(batch["input_ids"][row, pos] == eos for row, pos in enumerate(last))
    return last


@pytest.mark.slow  # a process of its own, or a real run
@pytest.mark.parametrize("pad", ["<eos>", None])
def test_reward_model_padded_with_eos_gets_a_distinct_pad_token(pad, tmp_path):
    tok = build_tokenizer()
    tok.pad_token = pad
    path = save_model(str(tmp_path / "rm"), task="seq_cls", tokenizer=tok)
    trainer = build_trainer("reward", path, tmp_path, rows=4)
    (finding,) = trainer.safety_report.by_rule("tokens.reward_pad_token")
    assert finding.action == "fixed" and trainer.args.pad_token == "<unk>"
    assert trainer.processing_class.pad_token == "<unk>" != trainer.processing_class.eos_token
    assert trainer.model.config.pad_token_id == trainer.processing_class.unk_token_id
    # the reward is read at the EOS that ends each text, not one token before it
    assert last_non_pad_positions(trainer) == eos_positions(trainer)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_reward_model_padded_with_eos_reads_one_token_early_without_the_rule(tmp_path):
    # the control: TRL pads with EOS, and the head reads the reward before the final EOS
    tok = build_tokenizer()
    tok.pad_token = "<eos>"
    path = save_model(str(tmp_path / "rm"), task="seq_cls", tokenizer=tok)
    trainer = build_trainer("reward", path, tmp_path, rows=4, safety_disable_rules=["tokens.reward_pad_token"])
    assert [p + 1 for p in last_non_pad_positions(trainer)] == eos_positions(trainer)


def test_reward_model_with_its_own_pad_token_untouched(toy_models, tmp_path):
    trainer = build_trainer("reward", toy_models["qwen2-rm"], tmp_path, rows=4)
    assert "tokens.reward_pad_token" not in actions(trainer) and trainer.args.pad_token is None
    assert last_non_pad_positions(trainer) == eos_positions(trainer)


# --------------------------------------------------------------------------------------------------------------------
# tokens.untrained_embeddings
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero_eos_model(tmp_path_factory) -> str:
    """A toy causal LM whose `<eos>` rows (id 1, appended to every completion by TRL) were never trained."""
    return save_model(str(tmp_path_factory.mktemp("zero-eos")), zero_rows=[1])


@pytest.mark.slow  # a process of its own, or a real run
def test_untrained_eos_embedding_set_to_the_mean(zero_eos_model, tmp_path):
    trainer = build_trainer("dpo", zero_eos_model, tmp_path)
    (finding,) = trainer.safety_report.by_rule("tokens.untrained_embeddings")
    assert finding.action == "fixed" and "`<eos>` (1)" in finding.message
    for model in (trainer.model, trainer.ref_model):
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):
            row, others = module.weight[1], module.weight[2:]
            torch.testing.assert_close(row, others.mean(dim=0), atol=1e-3, rtol=0)  # the mean of the trained rows
    torch.testing.assert_close(trainer.model.get_input_embeddings().weight, trainer.ref_model.get_input_embeddings().weight)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_untrained_eos_embedding_with_lora_warned(zero_eos_model, tmp_path):
    lora = LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"], r=4)
    trainer = build_trainer("dpo", zero_eos_model, tmp_path, rows=4, trainer_kwargs={"peft_config": lora})
    assert actions(trainer)["tokens.untrained_embeddings"] == "warned"
    assert trainer.model.get_input_embeddings().weight[1].abs().sum() == 0  # left alone


def test_trained_embeddings_untouched(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, rows=4)
    assert "tokens.untrained_embeddings" not in actions(trainer)


# --------------------------------------------------------------------------------------------------------------------
# grpo.vocab_size
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def padded_vocab_model(tmp_path_factory) -> str:
    """A toy model with `vocab_size=512` and the toy tokenizer's 384 tokens, like Qwen's padded embedding matrix."""
    return save_toy_model(str(tmp_path_factory.mktemp("vocab512")), "qwen2", vocab_size=512)


def sampled_ids(trainer_kwargs, path, tmp_path) -> list[int]:
    seen: list[int] = []

    def record(completions, completion_ids, **kwargs):
        seen.extend(i for ids in completion_ids for i in ids)
        return rank_reward(completions)

    trainer = build_trainer(
        "grpo", path, tmp_path, max_steps=2, **trainer_kwargs, trainer_kwargs={"reward_funcs": record}
    )
    trainer.train()
    return trainer, seen


@pytest.mark.slow  # a process of its own, or a real run
def test_grpo_padded_vocabulary_never_samples_ids_past_the_tokenizer(padded_vocab_model, tmp_path):
    trainer, seen = sampled_ids({}, padded_vocab_model, tmp_path)
    assert actions(trainer)["grpo.vocab_size"] == "fixed"
    assert trainer.generation_config.suppress_tokens == list(range(384, 512))
    assert seen and max(seen) < len(trainer.processing_class) == 384


@pytest.mark.slow  # a process of its own, or a real run
def test_grpo_padded_vocabulary_samples_undecodable_ids_without_the_rule(padded_vocab_model, tmp_path):
    # the control: a random policy samples ids 384..511, which the tokenizer decodes to nothing
    _, seen = sampled_ids({"safety_disable_rules": ["grpo.vocab_size"]}, padded_vocab_model, tmp_path)
    assert max(seen) >= 384


def test_grpo_vocabulary_matching_the_tokenizer_untouched(toy_models, tmp_path):
    trainer = build_trainer("grpo", toy_models["qwen2"], tmp_path, rows=4)
    assert "grpo.vocab_size" not in actions(trainer) and trainer.args.generation_kwargs is None
