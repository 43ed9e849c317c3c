"""Pure tests of the rules for the rest of the NaN catalogue: the reward model's pad token, untrained special-token
embeddings, a vocabulary padded past the tokenizer, vLLM importance sampling with truncated sampling, and a MoE router
loss added to the RL loss."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import MixtralConfig, Qwen3MoeConfig

from safe_trainers.rules import BuiltTrainer, get_rule
from safe_trainers.rules.grpo import padded_vocab_ids, truncated_sampling
from safe_trainers.rules.tokens import near_zero_rows, pad_candidates, template_token_ids
from safe_trainers.testing.toy import VOCAB_SIZE, build_model, build_tokenizer, model_config

from rule_utils import change_map, make_args, make_setup, run_setup_stage


PAD = get_rule("tokens.reward_pad_token")
EMBEDDINGS = get_rule("tokens.untrained_embeddings")
VOCAB = get_rule("grpo.vocab_size")
VLLM_IS = get_rule("grpo.vllm_is_truncation")
ROUTER = get_rule("moe.router_aux_loss")


def tokenizer(pad: str | None = "<pad>", unk: str | None = "<unk>"):
    tok = build_tokenizer()
    tok.pad_token = pad
    tok.unk_token = unk
    return tok


# --------------------------------------------------------------------------------------------------------------------
# tokens.reward_pad_token
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad, how", [("<eos>", "the pad token is the EOS token"), (None, "no pad token")])
def test_reward_pad_token_equal_to_eos_or_missing_is_fixed(pad, how):
    setup = make_setup("reward", "qwen2", tokenizer=tokenizer(pad=pad), args=make_args("reward"))
    finding = PAD.check(setup)
    assert finding.action == "fixed" and how in finding.message and "one token early" in finding.message
    assert change_map(finding) == {"args.pad_token": (None, "<unk>")}
    new, _ = run_setup_stage(setup)
    assert new.args.pad_token == "<unk>"


def test_reward_pad_token_without_a_spare_token_is_warned():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bare = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 2}, unk_token=None))
    tok = PreTrainedTokenizerFast(tokenizer_object=bare, eos_token="<eos>", pad_token="<eos>")
    finding = PAD.check(make_setup("reward", "qwen2", tokenizer=tok))
    assert finding.action == "warned" and "no unused token" in finding.message


@pytest.mark.parametrize(
    "tok, args_kw",
    [
        (tokenizer(), {}),  # a distinct pad token
        (tokenizer(pad="<eos>"), {"pad_token": "<unk>"}),  # the user already chose one
        (None, {}),  # no tokenizer could be read
    ],
)
def test_reward_pad_token_silent(tok, args_kw):
    assert PAD.check(make_setup("reward", "qwen2", tokenizer=tok, args=make_args("reward", **args_kw))) is None


def test_pad_candidates_skip_eos_bos_and_media_tokens():
    tok = tokenizer(pad="<eos>")
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_pad|>", "<|finetune_right_pad_id|>"]})
    assert pad_candidates(tok) == ["<unk>", "<pad>", "<|finetune_right_pad_id|>"]


# --------------------------------------------------------------------------------------------------------------------
# tokens.untrained_embeddings
# --------------------------------------------------------------------------------------------------------------------


def chat_tokenizer():
    """The toy tokenizer with a chat template that writes two special tokens, `<|im_start|>` and `<|im_end|>`."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|unused|>"]})
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    return tok


def model_with_zero_rows(ids, vocab_size=VOCAB_SIZE + 3):
    model = build_model("qwen2", vocab_size=vocab_size)
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weight[ids] = 0.0
    return model


def test_template_token_ids():
    tok = chat_tokenizer()
    ids = template_token_ids(tok)
    assert set(ids.values()) == {"<|im_start|>", "<|im_end|>", "<eos>"}  # not `<|unused|>`, not in the template


def test_untrained_template_tokens_are_set_to_the_mean():
    tok = chat_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    unused = tok.convert_tokens_to_ids("<|unused|>")
    model = model_with_zero_rows([im_end, unused])
    finding = EMBEDDINGS.check_built(BuiltTrainer("dpo", make_args("dpo"), model, processing_class=tok))
    assert finding.action == "fixed" and "`<|im_end|>`" in finding.message
    assert finding.data["rows"] == {"input": [im_end], "output": [im_end]}  # `<|unused|>` is not written


def test_untrained_embeddings_with_lora_are_warned():
    tok = chat_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model = get_peft_model(model_with_zero_rows([im_end]), LoraConfig(target_modules=["q_proj"], r=2))
    built = BuiltTrainer("dpo", make_args("dpo"), model, processing_class=tok, peft_config=model.peft_config["default"])
    finding = EMBEDDINGS.check_built(built)
    assert finding.action == "warned" and f"trainable_token_indices=[{im_end}]" in finding.message


def test_trained_embeddings_silent():
    tok = chat_tokenizer()
    model = build_model("qwen2", vocab_size=VOCAB_SIZE + 3)
    assert EMBEDDINGS.check_built(BuiltTrainer("dpo", make_args("dpo"), model, processing_class=tok)) is None
    assert EMBEDDINGS.check_built(BuiltTrainer("dpo", make_args("dpo"), model)) is None  # no tokenizer


def test_near_zero_rows():
    weight = torch.randn(100, 8)
    weight[[3, 7]] = 0.0
    weight[9] = 1e-6
    assert near_zero_rows(weight, [3, 7, 9, 10, 500]) == [3, 7, 9]
    assert near_zero_rows(torch.empty(0), [3]) == []  # a ZeRO-3 partitioned weight
    assert near_zero_rows(torch.zeros(10, 4), [1]) == []  # nothing trained at all: no reference


# --------------------------------------------------------------------------------------------------------------------
# grpo.vocab_size
# --------------------------------------------------------------------------------------------------------------------


def test_padded_vocabulary_suppressed_in_transformers_generation():
    setup = make_setup("grpo", "qwen2", config=model_config("qwen2", vocab_size=512), tokenizer=build_tokenizer())
    finding = VOCAB.check(setup)
    assert finding.action == "fixed" and "`vocab_size=512` is larger than the tokenizer (384 tokens)" in finding.message
    (change,) = finding.changes
    assert change.path == "args.generation_kwargs" and change.new["suppress_tokens"] == list(range(384, 512))
    new, _ = run_setup_stage(setup)
    assert new.args.generation_kwargs["suppress_tokens"] == list(range(384, 512))


def test_padded_vocabulary_keeps_the_users_generation_kwargs():
    args = make_args("grpo", generation_kwargs={"suppress_tokens": [7], "num_beams": 1})
    setup = make_setup("grpo", "qwen2", config=model_config("qwen2", vocab_size=386), args=args, tokenizer=build_tokenizer())
    assert VOCAB.check(setup).changes[0].new == {"suppress_tokens": [7, 384, 385], "num_beams": 1}


def test_padded_vocabulary_with_vllm_warned():
    args = make_args("grpo", use_vllm=True)
    setup = make_setup("grpo", "qwen2", config=model_config("qwen2", vocab_size=512), args=args, tokenizer=build_tokenizer())
    finding = VOCAB.check(setup)
    assert finding.action == "warned" and "vLLM samples from the model's full vocabulary" in finding.message


def test_vocabulary_matching_the_tokenizer_silent():
    assert VOCAB.check(make_setup("grpo", "qwen2", tokenizer=build_tokenizer())) is None
    assert VOCAB.check(make_setup("grpo", "qwen2")) is None  # no tokenizer
    assert padded_vocab_ids(384, 384) == range(0) and padded_vocab_ids(None, 10) == range(0)


# --------------------------------------------------------------------------------------------------------------------
# grpo.vllm_is_truncation
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args_kw, shown",
    [
        (dict(top_p=0.9), "`top_p=0.9`"),
        (dict(top_k=50), "`top_k=50`"),
        (dict(min_p=0.05), "`min_p=0.05`"),
        (dict(generation_kwargs={"top_k": 20}), "`top_k=20`"),
    ],
)
def test_vllm_importance_sampling_with_truncation_warned(args_kw, shown):
    args = make_args("grpo", use_vllm=True, **args_kw)
    finding = VLLM_IS.check(make_setup("grpo", "qwen2", args=args))
    assert finding.action == "warned" and shown in finding.message and "kept probability mass" in finding.message


@pytest.mark.parametrize(
    "args_kw",
    [
        dict(use_vllm=True),  # no truncation
        dict(use_vllm=True, top_p=0.9, vllm_importance_sampling_correction=False),
        dict(use_vllm=False, top_p=0.9),  # transformers generation: no importance-sampling correction
        dict(use_vllm=True, top_p=0.9, generation_kwargs={"top_p": 1.0}),  # overridden back to no truncation
    ],
)
def test_vllm_importance_sampling_silent(args_kw):
    assert VLLM_IS.check(make_setup("grpo", "qwen2", args=make_args("grpo", **args_kw))) is None
    assert truncated_sampling(make_args("grpo")) == []


# --------------------------------------------------------------------------------------------------------------------
# moe.router_aux_loss
# --------------------------------------------------------------------------------------------------------------------


def moe_config(cls=Qwen3MoeConfig, **overrides):
    return cls(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, **overrides)  # fmt: skip


@pytest.mark.parametrize("cls", [Qwen3MoeConfig, MixtralConfig])
def test_router_aux_loss_added_to_the_rl_loss_warned(cls):
    finding = ROUTER.check(make_setup("grpo", None, config=moe_config(cls), model="toy/moe"))
    assert finding.action == "warned" and "router load-balancing loss" in finding.message
    assert "`router_aux_loss_coef=0.0`" in finding.message


@pytest.mark.parametrize(
    "config, args_kw",
    [
        (moe_config(router_aux_loss_coef=0.0), {}),
        (moe_config(), {"router_aux_loss_coef": 0.0}),  # the user turned it off
        (model_config("qwen2"), {}),  # a dense model
    ],
)
def test_router_aux_loss_silent(config, args_kw):
    setup = make_setup("grpo", None, config=config, model="toy/m", args=make_args("grpo", **args_kw))
    assert ROUTER.check(setup) is None


def test_gemma2_flash_kept_with_a_flash_attn_that_soft_caps():
    # flash-attn 2.6.3 and later soft-cap in the backward pass too: a valid run, not rewritten to eager.
    import dataclasses

    from rule_utils import make_args, make_setup
    from safe_trainers.rules.hardware import Hardware
    from safe_trainers.rules import get_rule

    rule = get_rule("attention.gemma2_no_flash")
    args = make_args("dpo", model_init_kwargs={"attn_implementation": "flash_attention_2"})
    new = dataclasses.replace(Hardware(), flash_attn_version="2.7.4.post1")
    old = dataclasses.replace(Hardware(), flash_attn_version="2.5.9")
    assert rule.check(make_setup("dpo", "gemma2", args=args, hardware=new)) is None
    finding = rule.check(make_setup("dpo", "gemma2", args=args, hardware=old))
    assert finding.action == "fixed" and "2.5.9" in finding.message


def test_beta_unused_by_an_sft_only_dpo_loss_is_not_judged():
    from safe_trainers.rules.dpo import beta_problem

    assert beta_problem(float("inf"), ["sft"]) is None and beta_problem(0.0, ["sft"]) is None
    assert beta_problem(float("inf"), ["sigmoid", "sft"])[0] == "blocked"  # the sigmoid term does use it


def test_untrained_rows_trained_by_the_adapter_are_not_warned():
    from peft import LoraConfig

    from safe_trainers.rules.tokens import peft_trains_rows

    assert peft_trains_rows(LoraConfig(trainable_token_indices=[1, 5]), [1])
    assert peft_trains_rows(LoraConfig(modules_to_save=["embed_tokens", "lm_head"]), [1, 2])
    assert not peft_trains_rows(LoraConfig(target_modules=["q_proj"]), [1])
    assert not peft_trains_rows(LoraConfig(trainable_token_indices=[5]), [1])
