"""The tokenizer rules: `tokens.reward_pad_token` (a reward model's pad token equal to EOS, or missing) and
`tokens.untrained_embeddings` (near-zero embedding rows of the chat template's special tokens)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from safe_trainers.rules import BuiltTrainer, get_rule
from safe_trainers.rules.tokens import near_zero_rows, pad_candidates, peft_trains_rows, template_token_ids
from safe_trainers.testing.toy import VOCAB_SIZE, build_model, build_tokenizer

from rule_utils import change_map, make_args, make_setup, run_setup_stage  # tests/ is on sys.path, as for conftest


EMBEDDINGS = get_rule("tokens.untrained_embeddings")
PAD = get_rule("tokens.reward_pad_token")


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


def test_untrained_rows_trained_by_the_adapter_are_not_warned():
    assert peft_trains_rows(LoraConfig(trainable_token_indices=[1, 5]), [1])
    assert peft_trains_rows(LoraConfig(modules_to_save=["embed_tokens", "lm_head"]), [1, 2])
    assert not peft_trains_rows(LoraConfig(target_modules=["q_proj"]), [1])
    assert not peft_trains_rows(LoraConfig(trainable_token_indices=[5]), [1])
