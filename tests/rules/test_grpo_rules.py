"""The GRPO rules: `grpo.group_size` (in the rule and in the config), `grpo.vocab_size` (a vocabulary padded past the
tokenizer), `grpo.vllm_is_truncation` (vLLM importance sampling with truncated sampling) and `generation.ds3_gather`
(generation on ZeRO-3-sharded weights)."""

from __future__ import annotations

import math

import pytest
from accelerate.utils import DeepSpeedPlugin

from safe_trainers import GRPOConfig, SafetyError
from safe_trainers.rules import get_rule
from safe_trainers.rules.grpo import group_size_problems, padded_vocab_ids, truncated_sampling
from safe_trainers.testing.toy import build_tokenizer, model_config

from rule_utils import OUT, make_args, make_setup, run_setup_stage  # tests/ is on sys.path, as for conftest
from safe_trainers import GRPOTrainer
from trainer_utils import actions  # tests/ is on sys.path, as for conftest
from safe_trainers.testing.toy import dataset_for, rank_reward
import os
from safe_trainers.testing.build import preset_args
import trl


GROUP = get_rule("grpo.group_size")
VLLM_IS = get_rule("grpo.vllm_is_truncation")
VOCAB = get_rule("grpo.vocab_size")
DS3 = get_rule("generation.ds3_gather")
ZERO3 = {"zero_optimization": {"stage": 3}}


# --------------------------------------------------------------------------------------------------------------------
# grpo.group_size (rule and config)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_generations, batch, temperature, count, fragments",
    [
        (1, None, 1.0, 1, ["`num_generations=1`", "2 or more"]),
        (0, 8, 1.0, 1, ["`num_generations=0`"]),
        (3, 4, 1.0, 1, ["`generation_batch_size=4`", "not divisible by `num_generations=3`", "e.g. 3 or 6"]),
        (4, 2, 1.0, 1, ["`generation_batch_size=2`", "e.g. 4, through"]),
        (2, 4, 0.0, 1, ["`temperature=0.0`", "positive temperature"]),
        (2, 4, -0.5, 1, ["`temperature=-0.5`"]),
        (2, 4, math.nan, 1, ["`temperature=nan`"]),
        (2, 4, math.inf, 1, ["`temperature=inf`"]),
        (2, 4, None, 1, ["`temperature=None`"]),
        (1, 4, 0.0, 2, ["`num_generations=1`", "`temperature=0.0`"]),
        (3, 4, 0.0, 2, ["`generation_batch_size=4`", "`temperature=0.0`"]),
    ],
)
def test_group_size_problems(num_generations, batch, temperature, count, fragments):
    problems = group_size_problems(num_generations, batch, temperature)
    assert len(problems) == count
    text = " ".join(problems)
    for fragment in fragments:
        assert fragment in text


@pytest.mark.parametrize(
    "num_generations, batch, temperature", [(2, 4, 1.0), (8, 16, 0.7), (2, None, 1.0), (None, 4, 1.0)]
)
def test_group_size_valid(num_generations, batch, temperature):
    assert group_size_problems(num_generations, batch, temperature) == []


def test_group_size_rule_on_mutated_config():
    args = make_args("grpo", per_device_train_batch_size=4, num_generations=2)
    assert GROUP.check(make_setup("grpo", "qwen2", args=args)) is None
    args.num_generations = 3
    finding = GROUP.check(make_setup("grpo", "qwen2", args=args))
    assert finding.action == "blocked" and "num_generations=3" in finding.message
    args.num_generations = 2
    args.temperature = 0.0
    finding = GROUP.check(make_setup("grpo", "qwen2", args=args))
    assert finding.action == "blocked" and "`temperature=0.0`" in finding.message


def test_grpo_config_refuses_single_generation():
    with pytest.raises(SafetyError, match=r"\[grpo.group_size\] `num_generations=1`") as exc:
        GRPOConfig(output_dir=OUT, use_cpu=True, num_generations=1)
    assert [f.rule_id for f in exc.value.findings] == ["grpo.group_size"]


def test_grpo_config_refuses_zero_temperature():
    with pytest.raises(SafetyError, match=r"`temperature=0`.*positive temperature"):
        GRPOConfig(output_dir=OUT, use_cpu=True, num_generations=2, per_device_train_batch_size=2, temperature=0)


def test_grpo_config_names_every_bad_setting_at_once():
    with pytest.raises(SafetyError, match=r"\(1 problem\)") as exc:
        GRPOConfig(output_dir=OUT, use_cpu=True, num_generations=3, generation_batch_size=4, temperature=0.0)
    message = str(exc.value)
    assert "`generation_batch_size=4`" in message and "`temperature=0.0`" in message


def test_grpo_config_rule_disabled_leaves_trl_validation():
    with pytest.raises(ValueError, match="at least 2 generations") as exc:
        GRPOConfig(output_dir=OUT, use_cpu=True, num_generations=1, safety_disable_rules=["grpo.group_size"])
    assert not isinstance(exc.value, SafetyError)
    with pytest.raises(ValueError) as exc:
        GRPOConfig(output_dir=OUT, use_cpu=True, num_generations=1, safety_mode="off")
    assert not isinstance(exc.value, SafetyError)
    # temperature is not validated by TRL: with the rule off, the config is accepted
    assert (
        GRPOConfig(
            output_dir=OUT,
            use_cpu=True,
            num_generations=2,
            per_device_train_batch_size=2,
            temperature=0.0,
            safety_mode="off",
        ).temperature
        == 0.0
    )


def test_grpo_config_valid():
    args = GRPOConfig(output_dir=OUT, use_cpu=True, num_generations=2, per_device_train_batch_size=4)
    assert args.generation_batch_size == 4 and args.safety_mode == "fix"


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
# generation.ds3_gather
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_generation_on_zero3_sharded_weights_warned(kind):
    args = make_args(kind, ds3_gather_for_generation=False, max_completion_length=256)
    setup, report = run_setup_stage(make_setup(kind, "qwen2", args=args, deepspeed_config=ZERO3))
    (finding,) = [f for f in report.findings if f.rule_id == "generation.ds3_gather"]
    assert finding.action == "warned" and finding.changes == () and setup.args.ds3_gather_for_generation is False
    shown = ["256 tokens per completion", "`ds3_gather_for_generation=True`", '`use_vllm=True, vllm_mode="colocate"`']
    assert all(text in finding.message for text in shown)


@pytest.mark.parametrize(
    "args_kw, deepspeed_config",
    [
        (dict(), ZERO3),  # TRL's default gathers the weights once per generation
        (dict(ds3_gather_for_generation=False), {"zero_optimization": {"stage": 2}}),  # weights are not sharded
        (dict(ds3_gather_for_generation=False), None),
        (dict(ds3_gather_for_generation=False, use_vllm=True), ZERO3),  # vLLM generates from its own full copy
    ],
)
def test_generation_on_whole_weights_silent(args_kw, deepspeed_config):
    args = make_args("grpo", **args_kw)
    assert DS3.check(make_setup("grpo", "qwen2", args=args, deepspeed_config=deepspeed_config)) is None


@pytest.mark.parametrize("stage, gather, warned", [(3, False, True), (2, False, False), (3, True, False)])
def test_generation_under_accelerates_deepspeed_plugin(stage, gather, warned):
    # `accelerate launch --use_deepspeed --zero_stage N`: no `args.deepspeed`; the config carries accelerate's plugin.
    args = make_args("grpo", ds3_gather_for_generation=gather)
    args.deepspeed_plugin = DeepSpeedPlugin(zero_stage=stage)
    finding = DS3.check(make_setup("grpo", "qwen2", args=args))
    assert (finding is not None and finding.action == "warned") == warned


# --------------------------------------------------------------------------------------------------------------------
# On a real safe trainer, built (and where the claim needs it, trained) from a tiny model
# --------------------------------------------------------------------------------------------------------------------


def test_config_only_model_cannot_be_loaded(config_only_model, tmp_path):
    # the control for the two tests below: TRL itself fails on this directory when loading weights
    args = trl.GRPOConfig(**preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4))
    with pytest.raises(OSError):
        trl.GRPOTrainer(
            model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4)
        )


def test_grpo_group_not_dividing_batch_refused_before_loading(config_only_model, tmp_path):
    args = GRPOConfig(**preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4, num_generations=2))
    args.num_generations = 3  # mutated after the config validated itself
    with pytest.raises(
        SafetyError, match=r"\[grpo.group_size\] `generation_batch_size=4`.*`num_generations=3`"
    ) as exc:
        GRPOTrainer(model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4))
    assert [f.rule_id for f in exc.value.findings] == ["grpo.group_size"]
    assert not os.path.exists(args.output_dir)  # nothing was written for a refused configuration


def test_grpo_zero_temperature_refused_before_loading(config_only_model, tmp_path):
    args = GRPOConfig(**preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4))
    args.temperature = 0.0
    with pytest.raises(SafetyError, match=r"\[grpo.group_size\] `temperature=0.0`"):
        GRPOTrainer(model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4))


def test_grpo_config_refuses_bad_groups_up_front(tmp_path):
    with pytest.raises(SafetyError, match="`num_generations=1`"):
        GRPOConfig(**preset_args("grpo", tmp_path / "out", num_generations=1))
    with pytest.raises(SafetyError, match="`temperature=0`"):
        GRPOConfig(**preset_args("grpo", tmp_path / "out", temperature=0))


def test_grpo_group_rule_disabled_is_left_to_trl(toy_models, tmp_path):
    args = GRPOConfig(
        **preset_args(
            "grpo", tmp_path / "out", per_device_train_batch_size=4, safety_disable_rules=["grpo.group_size"]
        )
    )
    args.temperature = 0.0
    trainer = GRPOTrainer(
        model=toy_models["qwen2"], reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4)
    )
    assert trainer.args.temperature == 0.0
    assert actions(trainer)["grpo.group_size"] == "skipped"
