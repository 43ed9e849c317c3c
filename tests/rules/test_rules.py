"""Fast, pure tests of the rules, the engine, the report and the safety settings.

Nothing here loads weights or trains: every rule is run on a constructed `TrainerSetup` (or a `BuiltTrainer` around a
tiny in-memory module or dataset), so the whole file runs in a few seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
from dataclasses import FrozenInstanceError

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig, TaskType, get_peft_model

import safe_trainers
from safe_trainers import (
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    RewardConfig,
    SafetyArguments,
    SafetyError,
    SafetyReport,
    TrainingDivergedError,
)
from safe_trainers.rules.apply import apply_to_setup, replace_args
from safe_trainers.rules.engine import new_report, run_stage, select_rules, skipped_findings
from safe_trainers.kinds import TRAINER_KINDS
from safe_trainers.rules.report import REMOVED, Change, Finding
from safe_trainers.rules import DEFAULT_RULES, BuiltTrainer, get_rule, rule_ids
from safe_trainers.rules.attention import is_flash, softcap_safe_implementation
from safe_trainers.rules.data import kept_completion_tokens, rows_without_loss_tokens, token_counts
from safe_trainers.rules.grpo import group_size_problems
from safe_trainers.rules.optim import clipping_disabled
from safe_trainers.rules.precision import FP16_OVERFLOW_FAMILIES, is_fp16, requested_dtype
from safe_trainers.rules.context import Hardware, TrainerSetup, read_model_config, resolve_model_class
from safe_trainers.testing.toy import build_model, model_config

from rule_utils import (  # tests/ is on sys.path, as for conftest
    CPU, CUDA_BF16, CUDA_NO_BF16, OUT, change_map, make_args, make_setup, run_setup_stage, settings,
)  # fmt: skip


EXPECTED_IDS = [
    "peft.reward_seq_cls_lora",
    "precision.bf16_over_fp16",
    "attention.gemma2_no_flash",
    "optim.grad_clip",
    "logging.show_nonfinite",
    "grpo.group_size",
    "kto.batch_and_labels",
    "dpo.beta_positive",
    "data.no_loss_tokens",
    "precision.fp32_trainable_params",
    "precision.bf16_supported",
    "env.cublas_sigfpe",
    "optim.learning_rate",
    "tokens.reward_pad_token",
    "tokens.untrained_embeddings",
    "grpo.vocab_size",
    "grpo.vllm_is_truncation",
    "moe.router_aux_loss",
]


# --------------------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------------------


def test_rule_ids_are_stable_and_in_order():
    assert rule_ids() == EXPECTED_IDS
    assert len(set(rule_ids())) == len(rule_ids())


@pytest.mark.parametrize("rule", DEFAULT_RULES, ids=lambda r: r.id)
def test_every_rule_is_documented(rule):
    assert rule.summary.strip()
    assert rule.rationale.startswith("https://")
    assert rule.trainers and rule.trainers <= set(TRAINER_KINDS)
    assert get_rule(rule.id) is rule


def test_get_rule_unknown_lists_valid_ids():
    with pytest.raises(KeyError, match="Valid ids are: peft.reward_seq_cls_lora"):
        get_rule("nope")


@pytest.mark.parametrize(
    "kind, present, absent",
    [
        (
            "dpo",
            {"dpo.beta_positive", "data.no_loss_tokens"},
            {"grpo.group_size", "kto.batch_and_labels", "peft.reward_seq_cls_lora"},
        ),
        ("kto", {"kto.batch_and_labels", "dpo.beta_positive"}, {"grpo.group_size", "peft.reward_seq_cls_lora"}),
        ("reward", {"peft.reward_seq_cls_lora", "data.no_loss_tokens"}, {"grpo.group_size", "dpo.beta_positive"}),
        ("grpo", {"grpo.group_size"}, {"data.no_loss_tokens", "dpo.beta_positive", "kto.batch_and_labels"}),
        ("rloo", {"grpo.group_size"}, {"data.no_loss_tokens", "dpo.beta_positive", "kto.batch_and_labels"}),
        ("sft", {"data.no_loss_tokens", "optim.grad_clip"}, {"grpo.group_size", "dpo.beta_positive"}),
    ],
)
def test_select_rules_by_trainer_kind(kind, present, absent):
    enabled, disabled = select_rules(kind, settings())
    ids = {r.id for r in enabled}
    assert present <= ids and not (absent & ids)
    assert disabled == []
    common = {"precision.bf16_over_fp16", "optim.grad_clip", "logging.show_nonfinite", "attention.gemma2_no_flash"}
    assert common <= ids


def test_select_rules_splits_disabled_and_skipped_findings():
    enabled, disabled = select_rules("dpo", settings(disable=["optim.grad_clip", "grpo.group_size"]))
    assert "optim.grad_clip" not in {r.id for r in enabled}
    # grpo.group_size does not apply to DPO, so it is neither run nor reported as skipped there
    assert [r.id for r in disabled] == ["optim.grad_clip"]
    skipped = skipped_findings(disabled)
    assert [(f.rule_id, f.action) for f in skipped] == [("optim.grad_clip", "skipped")]
    assert "safety_disable_rules" in skipped[0].message


# --------------------------------------------------------------------------------------------------------------------
# precision.bf16_over_fp16
# --------------------------------------------------------------------------------------------------------------------

PREFER_BF16 = get_rule("precision.bf16_over_fp16")


@pytest.mark.parametrize(
    "family, hardware, args_kw, action, expected, message",
    [
        # fp16 flag on a machine with bf16 (the CPU here, `use_cpu` already set): fp16 -> bf16
        (
            "llama",
            CPU,
            dict(fp16=True),
            "fixed",
            {"args.fp16": (True, False), "args.bf16": (False, True)},
            "switched to bf16",
        ),
        # the CPU without `use_cpu`: transformers only accepts bf16 with `use_cpu=True`, so the rule sets it
        ("llama", CPU, dict(fp16=True, use_cpu=False), "fixed", {"args.use_cpu": (False, True)}, "switched to bf16"),
        # an overflow family names itself in the message
        ("gemma2", CUDA_BF16, dict(fp16=True), "fixed", {"args.bf16": (False, True)}, "`gemma2` activations overflow"),
        # fp16 load dtype only: the flag is untouched, the dtype becomes bf16
        (
            "llama",
            CPU,
            dict(model_init_kwargs={"dtype": "float16"}),
            "fixed",
            {"args.model_init_kwargs.dtype": ("float16", "bfloat16")},
            "model_init_kwargs\\['dtype'\\]='float16'",
        ),
        (
            "qwen2",
            CPU,
            dict(model_init_kwargs={"dtype": torch.float16}),
            "fixed",
            {"args.model_init_kwargs.dtype": (torch.float16, "bfloat16")},
            "switched to bf16",
        ),
        # the deprecated `torch_dtype` key is renamed to `dtype`
        (
            "llama",
            CPU,
            dict(model_init_kwargs={"torch_dtype": "half"}),
            "fixed",
            {
                "args.model_init_kwargs.dtype": (REMOVED, "bfloat16"),
                "args.model_init_kwargs.torch_dtype": ("half", REMOVED),
            },
            "torch_dtype",
        ),
        # no bf16: Gemma family -> fp32
        (
            "gemma2",
            CUDA_NO_BF16,
            dict(fp16=True),
            "fixed",
            {"args.fp16": (True, False)},
            "switched to fp32: this device has no bf16 and `gemma2`",
        ),
        (
            "gemma3",
            CUDA_NO_BF16,
            dict(model_init_kwargs={"dtype": "fp16"}),
            "fixed",
            {"args.model_init_kwargs.dtype": ("fp16", "float32")},
            "switched to fp32.*`gemma3_text`",
        ),
        # no bf16: Llama -> warned, nothing changed
        ("llama", CUDA_NO_BF16, dict(fp16=True), "warned", {}, "kept: this device has no bf16"),
        ("qwen2", CUDA_NO_BF16, dict(model_init_kwargs={"dtype": "float16"}), "warned", {}, "kept"),
    ],
)
def test_prefer_bf16_fires(family, hardware, args_kw, action, expected, message):
    setup = make_setup("dpo", family, hardware=hardware, args=make_args("dpo", **args_kw))
    finding = PREFER_BF16.check(setup)
    assert finding is not None and finding.rule_id == "precision.bf16_over_fp16"
    assert finding.action == action
    changes = change_map(finding)
    for path, (old, new) in expected.items():
        assert path in changes, changes
        assert changes[path][0] is old if old is REMOVED else changes[path][0] == old
        assert changes[path][1] is new if new is REMOVED else changes[path][1] == new
    if action == "warned":
        assert finding.changes == ()
    assert re.search(message, finding.message), finding.message


def test_prefer_bf16_no_use_cpu_change_off_cpu():
    finding = PREFER_BF16.check(
        make_setup("dpo", "llama", hardware=CUDA_BF16, args=make_args("dpo", fp16=True, use_cpu=False))
    )
    assert "args.use_cpu" not in change_map(finding)


@pytest.mark.parametrize(
    "hardware, args_kw",
    [
        (CPU, dict()),
        (CPU, dict(bf16=True)),
        (CPU, dict(model_init_kwargs={"dtype": "bfloat16"})),
        (CPU, dict(model_init_kwargs={"dtype": "float32"})),
        (CUDA_NO_BF16, dict(bf16=False)),
    ],
)
def test_prefer_bf16_silent(hardware, args_kw):
    for family in ("llama", "gemma2"):
        assert (
            PREFER_BF16.check(make_setup("dpo", family, hardware=hardware, args=make_args("dpo", **args_kw))) is None
        )


def test_no_bf16_gemma_fix_applies_fp32():
    args = make_args("dpo", fp16=True, model_init_kwargs={"torch_dtype": "float16"})
    setup = make_setup("dpo", "gemma2", hardware=CUDA_NO_BF16, args=args)
    new, report = run_setup_stage(setup)
    assert new.args.fp16 is False and new.args.bf16 is False
    assert new.args.model_init_kwargs == {"dtype": "float32"}
    assert [f.action for f in report.by_rule("precision.bf16_over_fp16")] == ["fixed"]
    # the user's config object is untouched
    assert args.fp16 is True and args.model_init_kwargs == {"torch_dtype": "float16"}


def test_no_bf16_llama_warned_and_unchanged():
    args = make_args("dpo", fp16=True, model_init_kwargs={"dtype": "float16"})
    setup = make_setup("dpo", "llama", hardware=CUDA_NO_BF16, args=args)
    new, report = run_setup_stage(setup, disable=["logging.show_nonfinite"])
    assert new.args is args  # nothing was applied
    assert new.args.fp16 is True and new.args.model_init_kwargs == {"dtype": "float16"}
    (finding,) = report.by_rule("precision.bf16_over_fp16")
    assert finding.action == "warned" and report.changes == []


def test_torch_dtype_renamed_to_dtype_on_apply():
    args = make_args("kto", model_init_kwargs={"torch_dtype": "float16", "attn_implementation": "eager"})
    new, _ = run_setup_stage(make_setup("kto", "qwen2", args=args), disable=["logging.show_nonfinite"])
    assert new.args.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "eager"}
    assert args.model_init_kwargs == {"torch_dtype": "float16", "attn_implementation": "eager"}
    assert isinstance(new.args, KTOConfig)


def test_fp16_helpers():
    assert all(is_fp16(v) for v in ("float16", "FP16", "half", "torch.float16", torch.float16))
    assert not any(is_fp16(v) for v in ("bfloat16", "auto", torch.bfloat16, torch.float32, None))
    assert requested_dtype({"torch_dtype": "half"}) == ("torch_dtype", "half")
    assert requested_dtype({"dtype": "auto", "torch_dtype": "half"}) == ("dtype", "auto")
    assert requested_dtype({}) is None
    assert {"gemma2", "gemma3_text", "t5"} <= FP16_OVERFLOW_FAMILIES
    assert not {"llama", "qwen2"} & FP16_OVERFLOW_FAMILIES


# --------------------------------------------------------------------------------------------------------------------
# DeepSpeed dict changes (precision + clipping)
# --------------------------------------------------------------------------------------------------------------------


def deepspeed_dict(**overrides):
    ds = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto"}
    ds.update(overrides)
    return ds


def test_deepspeed_fp16_and_clipping_fixed_in_a_copy():
    user_ds = deepspeed_dict(fp16={"enabled": True}, gradient_clipping=0.0)
    original = copy.deepcopy(user_ds)
    args = make_args("dpo", deepspeed=user_ds)
    setup = make_setup("dpo", "llama", args=args, deepspeed_config=user_ds)
    new, report = run_setup_stage(setup, disable=["logging.show_nonfinite"])
    assert new.deepspeed_config["fp16"]["enabled"] is False
    assert new.deepspeed_config["bf16"]["enabled"] is True
    assert new.deepspeed_config["gradient_clipping"] == 1.0
    assert new.args.deepspeed == new.deepspeed_config
    # neither the user's dict nor the user's config changed
    assert user_ds == original and args.deepspeed == original
    prec = change_map(report.by_rule("precision.bf16_over_fp16")[0])
    assert prec["args.deepspeed.fp16.enabled"] == (True, False)
    assert prec["args.deepspeed.bf16.enabled"][0] is REMOVED
    clip = change_map(report.by_rule("optim.grad_clip")[0])
    assert clip == {"args.deepspeed.gradient_clipping": (0.0, 1.0)}


@pytest.mark.parametrize(
    "ds, max_grad_norm, expected",
    [
        (deepspeed_dict(gradient_clipping="auto"), 1.0, None),
        (deepspeed_dict(gradient_clipping=1.0), 1.0, None),
        (deepspeed_dict(gradient_clipping=0.5), 0.5, None),
        (deepspeed_dict(gradient_clipping=0.0), 1.0, {"args.deepspeed.gradient_clipping": (0.0, 1.0)}),
        (deepspeed_dict(gradient_clipping=2.0), 0.5, {"args.deepspeed.gradient_clipping": (2.0, 0.5)}),
        (deepspeed_dict(), 1.0, {"args.deepspeed.gradient_clipping": (REMOVED, 1.0)}),
        (
            deepspeed_dict(gradient_clipping=0.0),
            0.0,
            {"args.max_grad_norm": (0.0, 1.0), "args.deepspeed.gradient_clipping": (0.0, 1.0)},
        ),
    ],
)
def test_grad_clip_deepspeed_agreement(ds, max_grad_norm, expected):
    setup = make_setup("dpo", "llama", args=make_args("dpo", max_grad_norm=max_grad_norm), deepspeed_config=ds)
    finding = get_rule("optim.grad_clip").check(setup)
    if expected is None:
        assert finding is None
    else:
        assert finding.action == "fixed"
        assert change_map(finding) == expected


def test_replace_args_deepspeed_path_without_deepspeed_config_is_an_error():
    with pytest.raises(ValueError, match="`args.deepspeed` is not set"):
        replace_args(make_args("dpo"), [Change("args.deepspeed.gradient_clipping", 0.0, 1.0)], None)


@pytest.mark.parametrize(
    "setup_kw",
    [
        pytest.param(dict(family="gemma2", args_kw=dict(fp16=True), hardware=CPU), id="fp16-flag-bf16-hw"),
        pytest.param(
            dict(family="llama", args_kw=dict(), hardware=CPU, ds=deepspeed_dict(fp16={"enabled": True})),
            id="deepspeed-fp16-only",
        ),
        pytest.param(
            dict(family="gemma2", args_kw=dict(fp16=True), hardware=CUDA_NO_BF16),
            id="no-bf16-gemma",
        ),
        pytest.param(dict(family="llama", args_kw=dict(max_grad_norm=0.0), hardware=CPU), id="grad-clip"),
        pytest.param(
            dict(family="gemma2", args_kw=dict(model_init_kwargs={"attn_implementation": "sdpa"}), hardware=CPU),
            id="attention",
        ),
    ],
)
def test_every_recorded_change_changes_something(setup_kw):
    args = make_args("dpo", **setup_kw["args_kw"])
    setup = make_setup(
        "dpo", setup_kw["family"], hardware=setup_kw["hardware"], args=args, deepspeed_config=setup_kw.get("ds")
    )
    findings = [f for f in (r.check(setup) for r in select_rules("dpo", settings())[0]) if f is not None]
    changes = [c for f in findings for c in f.changes]
    assert changes
    noops = [c.render() for c in changes if c.old is not REMOVED and c.new is not REMOVED and c.old == c.new]
    assert noops == []


# --------------------------------------------------------------------------------------------------------------------
# attention.gemma2_no_flash
# --------------------------------------------------------------------------------------------------------------------

ATTENTION = get_rule("attention.gemma2_no_flash")


class _SdpaCapable:
    _supports_sdpa = True


@pytest.mark.parametrize(
    "family, requested, expected_new",
    [
        ("gemma2", "sdpa", "eager"),
        ("gemma2", "flash_attention_2", "eager"),
        ("gemma2", "flash_attention_3", "eager"),
        ("gemma2", "kernels-community/flash-attn", "eager"),
        ("gemma2", "eager", None),
        ("gemma2", None, None),
        ("qwen2", "sdpa", None),
        ("llama", "flash_attention_2", None),
        ("gemma3", "sdpa", None),  # no soft-capping in the toy Gemma-3 config
    ],
)
def test_attention_rule_on_paths(family, requested, expected_new):
    mik = {} if requested is None else {"attn_implementation": requested}
    setup = make_setup("dpo", family, args=make_args("dpo", model_init_kwargs=mik))
    finding = ATTENTION.check(setup)
    if expected_new is None:
        assert finding is None
        return
    assert finding.action == "fixed"
    assert change_map(finding) == {"args.model_init_kwargs.attn_implementation": (requested, expected_new)}
    assert "attn_logit_softcapping=50.0" in finding.message
    assert ("backward pass" in finding.message) == is_flash(requested)


def test_attention_rule_prefers_sdpa_where_the_model_class_supports_it():
    assert softcap_safe_implementation(None) == "eager"
    assert softcap_safe_implementation(_SdpaCapable) == "sdpa"
    args = make_args("dpo", model_init_kwargs={"attn_implementation": "flash_attention_2"})
    setup = make_setup("dpo", "gemma2", args=args)
    setup = dataclasses.replace(setup, model_class=_SdpaCapable)
    finding = ATTENTION.check(setup)
    assert change_map(finding) == {"args.model_init_kwargs.attn_implementation": ("flash_attention_2", "sdpa")}
    # sdpa requested and sdpa is the safe choice: nothing to do
    setup = dataclasses.replace(setup, args=make_args("dpo", model_init_kwargs={"attn_implementation": "sdpa"}))
    assert ATTENTION.check(setup) is None


def test_attention_rule_softcapped_gemma3_config():
    cfg = model_config("gemma3", attn_logit_softcapping=30.0)
    setup = TrainerSetup(
        kind="dpo",
        args=make_args("dpo", model_init_kwargs={"attn_implementation": "flash_attention_2"}),
        model="toy/gemma3",
        model_config=cfg,
        model_class=resolve_model_class("dpo", "toy/gemma3", cfg),
    )
    finding = ATTENTION.check(setup)
    assert finding is not None
    new = change_map(finding)["args.model_init_kwargs.attn_implementation"][1]
    assert new == softcap_safe_implementation(setup.model_class)


@pytest.fixture(scope="module")
def gemma2_instance():
    return build_model("gemma2")


@pytest.mark.parametrize("current", ["flash_attention_2", "sdpa"])
def test_attention_rule_on_instances_and_ref_model(gemma2_instance, current):
    model = gemma2_instance
    ref = copy.deepcopy(model)
    model.config._attn_implementation = current
    ref.config._attn_implementation = current
    setup = make_setup("dpo", "gemma2", model=model, ref_model=ref)
    finding = ATTENTION.check(setup)
    assert change_map(finding) == {
        "model.attn_implementation": (current, "eager"),
        "ref_model.attn_implementation": (current, "eager"),
    }
    new = apply_to_setup(setup, finding)
    assert new.model is model and model.config._attn_implementation == "eager"
    assert ref.config._attn_implementation == "eager"
    assert ATTENTION.check(new) is None


def test_attention_rule_leaves_eager_instance_alone(gemma2_instance):
    gemma2_instance.config._attn_implementation = "eager"
    assert ATTENTION.check(make_setup("dpo", "gemma2", model=gemma2_instance)) is None


# --------------------------------------------------------------------------------------------------------------------
# optim.grad_clip and logging.show_nonfinite
# --------------------------------------------------------------------------------------------------------------------

GRAD_CLIP = get_rule("optim.grad_clip")


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
# grpo.group_size (rule and config)
# --------------------------------------------------------------------------------------------------------------------

GROUP = get_rule("grpo.group_size")


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
# kto.batch_and_labels and dpo.beta_positive
# --------------------------------------------------------------------------------------------------------------------

KTO = get_rule("kto.batch_and_labels")
BETA = get_rule("dpo.beta_positive")


def kto_data(labels):
    return Dataset.from_dict({"prompt": ["p"] * len(labels), "completion": ["c"] * len(labels), "label": labels})


@pytest.mark.parametrize("labels", [[True, False], [True, True], None])
@pytest.mark.parametrize("loss_type", ["kto", None])
def test_kto_rule_blocks_a_batch_of_one_with_the_kl_term(labels, loss_type):
    data = kto_data(labels) if labels is not None else None
    args = make_args("kto", per_device_train_batch_size=1)
    if loss_type is None:
        args.loss_type = None  # TRL's default is "kto"
    finding = KTO.check(make_setup("kto", "qwen2", args=args, train_dataset=data))
    assert finding.action == "blocked"
    assert "`per_device_train_batch_size=1` with `loss_type='kto'`" in finding.message
    assert 'loss_type="apo_zero_unpaired"' in finding.message  # the way out that keeps a batch of 1


@pytest.mark.parametrize(
    "data",
    [
        kto_data([True, False, True]),
        None,
        Dataset.from_dict({"prompt": ["p"], "completion": ["c"]}),  # no label column
        Dataset.from_dict({"prompt": ["p"], "completion": ["c"], "label": [True]}).to_iterable_dataset(),
        # one label kind only: TRL skips the empty side of the loss and averages with `nanmean` (it trains)
        kto_data([True, True, True]),
        kto_data([False, False]),
    ],
)
def test_kto_rule_silent(data):
    assert (
        KTO.check(make_setup("kto", "qwen2", args=make_args("kto", per_device_train_batch_size=2), train_dataset=data))
        is None
    )


@pytest.mark.parametrize("labels", [[True, False], [True, True]])
def test_kto_rule_silent_for_a_batch_of_one_without_the_kl_term(labels):
    # `apo_zero_unpaired` has no KL term, so TRL trains it with a batch of 1 (was a false alarm)
    args = make_args("kto", per_device_train_batch_size=1, loss_type="apo_zero_unpaired")
    assert KTO.check(make_setup("kto", "qwen2", args=args, train_dataset=kto_data(labels))) is None


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize("beta", [math.nan, math.inf, -math.inf])
def test_beta_positive_blocks_non_finite(kind, beta):
    args = make_args(kind)
    args.beta = beta
    finding = BETA.check(make_setup(kind, "qwen2", args=args))
    assert finding.action == "blocked"
    assert f"`beta={beta}`" in finding.message and "Use a positive value" in finding.message


@pytest.mark.parametrize("loss_type", ["ipo", "sppo_hard", ["sigmoid", "ipo"]])
def test_beta_zero_blocked_for_losses_that_divide_by_it(loss_type):
    finding = BETA.check(make_setup("dpo", "qwen2", args=make_args("dpo", beta=0.0, loss_type=loss_type)))
    assert finding.action == "blocked" and "division by zero" in finding.message


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize("beta, fragment", [(0.0, "learns nothing"), (-0.1, "rejected answers")])
def test_beta_zero_or_negative_warned(kind, beta, fragment):
    # TRL trains these (constant loss, or the wrong direction): warned, not refused
    finding = BETA.check(make_setup(kind, "qwen2", args=make_args(kind, beta=beta)))
    assert finding.action == "warned" and fragment in finding.message


@pytest.mark.parametrize("kind", ["dpo", "kto", "reward"])
def test_beta_positive_silent(kind):
    assert BETA.check(make_setup(kind, "qwen2", args=make_args(kind))) is None


@pytest.mark.parametrize("mode", ["fix", "warn", "strict"])
def test_blocked_finding_raises_in_every_mode(mode):
    args = make_args("dpo", beta=0.0, loss_type="ipo")
    with pytest.raises(SafetyError, match=r"\[dpo.beta_positive\] `beta=0.0` with `loss_type='ipo'`"):
        run_setup_stage(make_setup("dpo", "qwen2", args=args), mode=mode)


# --------------------------------------------------------------------------------------------------------------------
# peft.reward_seq_cls_lora
# --------------------------------------------------------------------------------------------------------------------

REWARD_LORA = get_rule("peft.reward_seq_cls_lora")


@pytest.mark.parametrize(
    "task_type, mik, model_is_path, expected",
    [
        (None, {}, True, {"peft_config.task_type": (None, "SEQ_CLS")}),
        ("CAUSAL_LM", {}, True, {"peft_config.task_type": ("CAUSAL_LM", "SEQ_CLS")}),
        (TaskType.CAUSAL_LM, {}, True, {"peft_config.task_type": ("CAUSAL_LM", "SEQ_CLS")}),
        ("SEQ_CLS", {"dtype": "float16"}, True, {"args.model_init_kwargs.dtype": ("float16", "auto")}),
        (
            "SEQ_CLS",
            {"torch_dtype": torch.float16},
            True,
            {
                "args.model_init_kwargs.dtype": (REMOVED, "auto"),
                "args.model_init_kwargs.torch_dtype": (torch.float16, REMOVED),
            },
        ),
        (
            None,
            {"dtype": "float16"},
            True,
            {"peft_config.task_type": (None, "SEQ_CLS"), "args.model_init_kwargs.dtype": ("float16", "auto")},
        ),
        ("SEQ_CLS", {}, True, None),
        (TaskType.SEQ_CLS, {"dtype": "bfloat16"}, True, None),
        ("SEQ_CLS", {"dtype": "float16"}, False, None),  # an instance: the load dtype is not ours to change
    ],
)
def test_reward_lora_check(task_type, mik, model_is_path, expected):
    peft_config = LoraConfig(task_type=task_type, target_modules=["q_proj", "v_proj"])
    model = None if model_is_path else build_model("qwen2", "seq_cls")
    setup = make_setup(
        "reward",
        "qwen2",
        model=model,
        config=model_config("qwen2", dtype="float32"),  # a checkpoint stored in fp32: "auto" loads fp32
        args=make_args("reward", model_init_kwargs=mik),
        peft_config=peft_config,
    )
    finding = REWARD_LORA.check(setup)
    if expected is None:
        assert finding is None
        return
    assert finding.action == "fixed"
    got = change_map(finding)
    assert set(got) == set(expected)
    for path, (old, new) in expected.items():
        assert (got[path][0] is REMOVED) if old is REMOVED else got[path][0] == old
        assert (got[path][1] is REMOVED) if new is REMOVED else got[path][1] == new


@pytest.mark.parametrize("stored", ["float16", None])
def test_reward_lora_leaves_fp16_to_the_precision_rule_when_auto_could_load_fp16(stored):
    # `dtype="auto"` would load a checkpoint stored in fp16 in fp16 (or an unknown one maybe): the precision rule,
    # which runs next, turns the fp16 request into bf16 instead
    peft_config = LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"])
    args = make_args("reward", model_init_kwargs={"dtype": "float16"})
    config = model_config("gemma2", dtype=stored) if stored else model_config("gemma2")
    setup = make_setup("reward", "gemma2", config=config, args=args, peft_config=peft_config)
    assert REWARD_LORA.check(setup) is None
    new, report = run_setup_stage(setup)
    assert new.args.model_init_kwargs == {"dtype": "bfloat16"}
    assert [f.action for f in report.by_rule("precision.bf16_over_fp16")] == ["fixed"]


def test_reward_lora_without_peft_is_silent():
    setup = make_setup("reward", "qwen2", args=make_args("reward", model_init_kwargs={"dtype": "float16"}))
    assert REWARD_LORA.check(setup) is None


def test_reward_lora_fix_copies_the_peft_config_and_runs_before_precision():
    peft_config = LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"])
    args = make_args("reward", model_init_kwargs={"dtype": "float16"})
    config = model_config("qwen2", dtype="float32")
    setup = make_setup("reward", "qwen2", config=config, args=args, peft_config=peft_config)
    new, report = run_setup_stage(setup)
    assert new.peft_config is not peft_config and new.peft_config.task_type == "SEQ_CLS"
    assert peft_config.task_type == "CAUSAL_LM"  # the user's PEFT config is untouched
    assert new.peft_config.target_modules == peft_config.target_modules
    assert new.args.model_init_kwargs == {"dtype": "auto"} and args.model_init_kwargs == {"dtype": "float16"}
    # the LoRA rule picked `dtype="auto"` first, so the precision rule found nothing left to switch to bf16
    assert report.by_rule("precision.bf16_over_fp16") == []
    assert [f.rule_id for f in report.findings] == ["peft.reward_seq_cls_lora", "logging.show_nonfinite"]


def test_warn_mode_shows_what_each_rule_would_do():
    peft_config = LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"])
    args = make_args("reward", model_init_kwargs={"dtype": "float16"})
    setup = make_setup("reward", "qwen2", config=model_config("qwen2", dtype="float32"), args=args, peft_config=peft_config)
    new, report = run_setup_stage(setup, mode="warn")
    assert new.args is args and new.peft_config is peft_config
    # nothing was applied, so the precision rule still sees the fp16 load dtype
    assert [(f.rule_id, f.action) for f in report.findings] == [
        ("peft.reward_seq_cls_lora", "warned"),
        ("precision.bf16_over_fp16", "warned"),
        ("logging.show_nonfinite", "warned"),
    ]
    assert all('(not applied: `safety_mode="warn"`)' in f.message for f in report.findings)
    assert report.changes == []  # warned findings keep their changes for the record, but none counts as applied


def _seq_cls_lora(task_type="SEQ_CLS", dtype=torch.float32, **lora):
    model = build_model("qwen2", "seq_cls").to(dtype)
    config = LoraConfig(task_type=task_type, target_modules=["q_proj", "v_proj"], r=2, **lora)
    return get_peft_model(model, config, autocast_adapter_dtype=False), config


def test_reward_lora_check_built():
    model, config = _seq_cls_lora()
    assert REWARD_LORA.check_built(BuiltTrainer("reward", make_args("reward"), model, peft_config=config)) is None

    # a frozen head has a fix (train it and save it with the adapter): fixed, not refused
    frozen, config = _seq_cls_lora(task_type=None)
    finding = REWARD_LORA.check_built(BuiltTrainer("reward", make_args("reward"), frozen, peft_config=config))
    assert finding.action == "fixed" and "is frozen in the PEFT model" in finding.message
    assert finding.changes == (Change("model.peft_config.modules_to_save", None, ["score"]),)

    # no head this rule knows by name: it cannot check it, so it says so (a custom head may be trained)
    no_head = get_peft_model(build_model("qwen2"), LoraConfig(target_modules=["q_proj"], r=2))
    finding = REWARD_LORA.check_built(
        BuiltTrainer("reward", make_args("reward"), no_head, peft_config=no_head.peft_config["default"])
    )
    assert finding.action == "warned" and "no `score` or `classifier` head" in finding.message

    half, config = _seq_cls_lora(dtype=torch.float16)
    finding = REWARD_LORA.check_built(BuiltTrainer("reward", make_args("reward"), half, peft_config=config))
    assert finding.action == "fixed" and "fp16" in finding.message
    assert finding.changes == (Change("model.trainable_params.dtype", "float16", "float32"),)
    assert finding.data["names"] and all(n in dict(half.named_parameters()) for n in finding.data["names"])

    # without PEFT the rule has nothing to say
    assert (
        REWARD_LORA.check_built(BuiltTrainer("reward", make_args("reward"), build_model("qwen2", "seq_cls"))) is None
    )


# --------------------------------------------------------------------------------------------------------------------
# precision.fp32_trainable_params
# --------------------------------------------------------------------------------------------------------------------


def test_fp32_trainable_params():
    rule = get_rule("precision.fp32_trainable_params")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).half()
    model[1].weight.requires_grad_(False)
    finding = rule.check_built(BuiltTrainer("dpo", make_args("dpo"), model))
    assert finding.action == "fixed"
    assert finding.data["names"] == ["0.weight", "0.bias", "1.bias"]  # the frozen fp16 weight is left alone
    assert "3 trainable parameter(s) are fp16" in finding.message
    assert rule.check_built(BuiltTrainer("dpo", make_args("dpo"), torch.nn.Linear(2, 2))) is None
    assert rule.check_built(BuiltTrainer("dpo", make_args("dpo"), torch.nn.Linear(2, 2).bfloat16())) is None
    assert rule.check(make_setup("dpo")) is None  # a build-time rule only


# --------------------------------------------------------------------------------------------------------------------
# data.no_loss_tokens
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_len, completion_len, max_length, mode, kept",
    [
        (5, 3, None, "keep_start", 3),
        (5, 3, 8, "keep_start", 3),
        (5, 3, 100, "keep_start", 3),
        (5, 3, 6, "keep_start", 1),
        (5, 3, 5, "keep_start", 0),
        (10, 3, 8, "keep_start", 0),
        (0, 3, 2, "keep_start", 2),
        (5, 0, 8, "keep_start", 0),
        (10, 3, 8, "keep_end", 3),
        (10, 12, 8, "keep_end", 8),
        (5, 0, 8, "keep_end", 0),
        (5, 3, None, "keep_end", 3),
    ],
)
def test_kept_completion_tokens(prompt_len, completion_len, max_length, mode, kept):
    assert kept_completion_tokens(prompt_len, completion_len, max_length, mode) == kept


def test_rows_without_loss_tokens():
    dpo = {"prompt_ids": [4, 10, 3, 2], "chosen_ids": [3, 3, 0, 2], "rejected_ids": [3, 3, 2, 2]}
    assert rows_without_loss_tokens("dpo", dpo, 8, "keep_start") == [1, 2]
    assert rows_without_loss_tokens("dpo", dpo, 8, "keep_end") == [2]
    assert rows_without_loss_tokens("dpo", dpo, None, "keep_start") == [2]
    assert rows_without_loss_tokens("dpo", dpo, 100, "keep_start") == [2]
    kto = {"prompt_ids": [4, 8, 2], "completion_ids": [2, 2, 0]}
    # KTO's collator always keeps the start, whatever `truncation_mode` says
    assert rows_without_loss_tokens("kto", kto, 8, "keep_start") == [1, 2]
    reward = {"chosen_ids": [3, 0, 2, 4], "rejected_ids": [2, 2, 0, 4]}
    assert rows_without_loss_tokens("reward", reward, 8, "keep_start") == [1, 2]
    assert rows_without_loss_tokens("reward", {"chosen_ids": [1], "rejected_ids": [1]}, None, "keep_start") == []


def _tokenized_dpo(prompt_lens, completion_len=3):
    n = len(prompt_lens)
    return Dataset.from_dict(
        {
            "prompt_ids": [[7] * p for p in prompt_lens],
            "chosen_ids": [[8] * completion_len] * n,
            "rejected_ids": [[9] * completion_len] * n,
        }
    )


def test_token_counts_reads_arrow_lengths():
    data = _tokenized_dpo([1, 4, 0])
    assert token_counts(data, ("prompt_ids", "chosen_ids")) == {"prompt_ids": [1, 4, 0], "chosen_ids": [3, 3, 3]}
    assert token_counts(data, ("completion_ids",)) is None
    assert token_counts(None, ("prompt_ids",)) is None


def test_no_loss_tokens_check_built():
    rule = get_rule("data.no_loss_tokens")
    args = make_args("dpo", max_length=8)
    finding = rule.check_built(BuiltTrainer("dpo", args, None, train_dataset=_tokenized_dpo([2, 8, 3, 9, 1])))
    assert finding.action == "fixed"
    assert finding.changes == (Change("train_dataset.num_rows", 5, 3),)
    assert finding.data["drop_rows"] == [1, 3]
    assert "2 of 5 training examples" in finding.message and "`max_length=8`" in finding.message

    finding = rule.check_built(BuiltTrainer("dpo", args, None, train_dataset=_tokenized_dpo([8, 9])))
    assert finding.action == "blocked" and "all 2 training examples" in finding.message

    assert rule.check_built(BuiltTrainer("dpo", args, None, train_dataset=_tokenized_dpo([1, 2]))) is None
    keep_end = make_args("dpo", max_length=8, truncation_mode="keep_end")
    assert rule.check_built(BuiltTrainer("dpo", keep_end, None, train_dataset=_tokenized_dpo([8, 9]))) is None
    # an untokenized dataset (no `*_ids` columns) is not checked
    raw = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    assert rule.check_built(BuiltTrainer("dpo", args, None, train_dataset=raw)) is None


def test_no_loss_tokens_blocked_raises_through_engine():
    rule = get_rule("data.no_loss_tokens")
    built = BuiltTrainer(
        "kto",
        make_args("kto", max_length=4),
        None,
        train_dataset=Dataset.from_dict({"prompt_ids": [[1] * 4], "completion_ids": [[2]]}),
    )
    s = settings()
    with pytest.raises(SafetyError, match=r"\[data.no_loss_tokens\] all 1 training examples"):
        run_stage(built, [rule], s.safety_mode, new_report("kto", s), check=lambda r, b: r.check_built(b), apply=lambda b, f: b)


# --------------------------------------------------------------------------------------------------------------------
# Engine: modes
# --------------------------------------------------------------------------------------------------------------------


def _unsafe_gemma_setup():
    args = make_args(
        "dpo", fp16=True, max_grad_norm=0.0, model_init_kwargs={"attn_implementation": "flash_attention_2"}
    )
    return make_setup("dpo", "gemma2", args=args), args


def test_engine_fix_mode_applies_every_fix_in_a_new_config():
    setup, args = _unsafe_gemma_setup()
    new, report = run_setup_stage(setup)
    assert [(f.rule_id, f.action) for f in report.findings] == [
        ("precision.bf16_over_fp16", "fixed"),
        ("attention.gemma2_no_flash", "fixed"),
        ("optim.grad_clip", "fixed"),
        ("logging.show_nonfinite", "fixed"),
    ]
    a = new.args
    assert (a.fp16, a.bf16, a.max_grad_norm, a.logging_nan_inf_filter) == (False, True, 1.0, False)
    assert a.model_init_kwargs == {"attn_implementation": "eager"}
    assert type(a) is DPOConfig and a is not args
    # the user's config object is never mutated
    assert (args.fp16, args.bf16, args.max_grad_norm, args.logging_nan_inf_filter) == (True, False, 0.0, True)
    assert args.model_init_kwargs == {"attn_implementation": "flash_attention_2"}
    assert len(report.changes) == sum(len(f.changes) for f in report.findings)


def test_engine_warn_mode_changes_nothing():
    setup, args = _unsafe_gemma_setup()
    new, report = run_setup_stage(setup, mode="warn")
    assert new is setup and new.args is args
    assert {f.action for f in report.findings} == {"warned"}
    assert len(report.findings) == 4
    assert report.changes == []
    assert args.fp16 is True and args.max_grad_norm == 0.0


def test_engine_strict_mode_raises_one_error_listing_every_finding():
    setup, args = _unsafe_gemma_setup()
    with pytest.raises(SafetyError, match=r"refused this configuration \(3 problems\)") as exc:
        run_setup_stage(setup, mode="strict")
    err = exc.value
    # TRL's default `logging_nan_inf_filter=True` is changed, but it is not a problem of this config (issue 12).
    assert [f.rule_id for f in err.findings] == [
        "precision.bf16_over_fp16",
        "attention.gemma2_no_flash",
        "optim.grad_clip",
    ]
    assert all(f.action == "blocked" for f in err.findings)
    message = str(err)
    for f in err.findings:
        assert f"[{f.rule_id}]" in message
    assert "safety_disable_rules" in message and 'safety_mode="off"' in message
    assert args.fp16 is True  # nothing applied


def test_engine_strict_mode_blocks_plain_warnings_too():
    setup = make_setup("dpo", "llama", args=make_args("dpo", max_grad_norm=50.0, logging_nan_inf_filter=False))
    with pytest.raises(SafetyError, match=r"\(1 problem\):\n  \[optim.grad_clip\] `max_grad_norm=50.0`"):
        run_setup_stage(setup, mode="strict")


def test_engine_strict_mode_passes_a_clean_setup():
    setup = make_setup("dpo", "llama", args=make_args("dpo", logging_nan_inf_filter=False))
    new, report = run_setup_stage(setup, mode="strict")
    assert new is setup and report.findings == []
    assert report.render() == "safe_trainers (dpo): all safety rules passed, nothing changed."


def test_engine_blocked_findings_raise_before_any_fix():
    args = make_args("kto", per_device_train_batch_size=1, beta=math.nan, max_grad_norm=0.0)
    setup = make_setup("kto", "qwen2", args=args, train_dataset=kto_data([True, True]))
    s = settings()
    enabled, _ = select_rules("kto", s)
    report = new_report("kto", s)
    with pytest.raises(SafetyError, match=r"\(2 problems\)") as exc:
        run_stage(setup, enabled, s.safety_mode, report, check=lambda r, t: r.check(t), apply=apply_to_setup)
    assert [f.rule_id for f in exc.value.findings] == ["kto.batch_and_labels", "dpo.beta_positive"]
    assert "optim.grad_clip" not in str(exc.value)
    # Blocked findings raise before any fix is applied: nothing was changed or recorded as fixed.
    assert report.by_rule("optim.grad_clip") == []
    assert setup.args.max_grad_norm == 0.0


def test_engine_later_rules_see_earlier_fixes():
    seen = []

    class Recorder(safe_trainers.Rule):
        id = "test.recorder"
        summary = "records what it sees"

        def check(self, setup):
            seen.append(setup.args.max_grad_norm)
            return None

    setup = make_setup("dpo", "llama", args=make_args("dpo", max_grad_norm=0.0))
    rules = (get_rule("optim.grad_clip"), Recorder())
    run_setup_stage(setup, mode="fix", rules=rules)
    run_setup_stage(setup, mode="warn", rules=rules)
    # fix: a first pass on the setup as given (for blocked findings), then the applying pass sees the fix;
    # warn: the first pass only.
    assert seen == [0.0, 1.0, 0.0]


def test_disabled_rules_are_skipped_and_reported():
    args = make_args("dpo", max_grad_norm=0.0)
    new, report = run_setup_stage(make_setup("dpo", "llama", args=args), disable=["optim.grad_clip"])
    assert new.args.max_grad_norm == 0.0
    assert new.args.logging_nan_inf_filter is False
    assert [(f.rule_id, f.action) for f in report.findings] == [
        ("optim.grad_clip", "skipped"),
        ("logging.show_nonfinite", "fixed"),
    ]
    assert "[skipped] optim.grad_clip" in report.render()
    assert report.changes == [Change("args.logging_nan_inf_filter", True, False)]


# --------------------------------------------------------------------------------------------------------------------
# apply_to_setup
# --------------------------------------------------------------------------------------------------------------------


def test_apply_to_setup_never_mutates_user_config():
    mik = {"dtype": "float16", "attn_implementation": "sdpa"}
    args = make_args("dpo", fp16=True, max_grad_norm=0.0, model_init_kwargs=mik)
    snapshot = dict(vars(args))
    setup = make_setup("dpo", "gemma2", args=args)
    for rule in select_rules("dpo", settings())[0]:
        finding = rule.check(setup)
        if finding is not None and finding.action == "fixed":
            setup = apply_to_setup(setup, finding)
    assert setup.args is not args
    assert setup.args.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "eager"}
    assert mik == {"dtype": "float16", "attn_implementation": "sdpa"}
    assert vars(args) == snapshot


def test_apply_to_setup_returns_same_setup_without_changes():
    setup = make_setup("dpo")
    assert apply_to_setup(setup, Finding("x", "fixed", "nothing")) is setup


def test_apply_to_setup_unknown_path_is_an_error():
    with pytest.raises(ValueError, match="No way to apply a change to `train_dataset.num_rows` before construction"):
        apply_to_setup(make_setup("dpo"), Finding("x", "fixed", "m", (Change("train_dataset.num_rows", 3, 2),)))


def test_apply_to_setup_keeps_plain_trl_config_class():
    args = trl.DPOConfig(output_dir=OUT, use_cpu=True, report_to="none", max_grad_norm=0.0)
    setup = TrainerSetup(kind="dpo", args=args, model="toy/llama", model_config=model_config("llama"))
    new, _ = run_setup_stage(setup)
    assert type(new.args) is trl.DPOConfig
    assert new.args.max_grad_norm == 1.0 and args.max_grad_norm == 0.0


def test_apply_to_setup_grpo_derived_fields():
    args = make_args(
        "grpo", per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=2, max_grad_norm=0.0
    )
    assert (args.generation_batch_size, args.steps_per_generation) == (8, 2)
    new, _ = run_setup_stage(make_setup("grpo", "qwen2", args=args))
    assert (new.args.generation_batch_size, new.args.steps_per_generation) == (8, 2)
    assert new.args.max_grad_norm == 1.0


def test_trainer_setup_is_read_only():
    setup = make_setup("dpo")
    with pytest.raises(FrozenInstanceError):
        setup.args = None
    with pytest.raises(FrozenInstanceError):
        CPU.bf16_supported = False


def test_trainer_setup_views(gemma2_instance):
    setup = make_setup("dpo", "gemma3", args=make_args("dpo", model_init_kwargs={"dtype": "auto"}))
    assert setup.model_is_path and setup.model_name == "toy/gemma3"
    assert setup.model_types == {"gemma3_text"}
    kwargs = setup.model_init_kwargs
    kwargs["dtype"] = "float16"
    assert setup.args.model_init_kwargs == {"dtype": "auto"}  # a copy
    inst = make_setup("dpo", "gemma2", model=gemma2_instance)
    assert not inst.model_is_path and inst.model_types == {"gemma2"}
    assert TrainerSetup(kind="dpo", args=make_args("dpo")).model_types == set()
    assert Hardware() == CPU
    assert Hardware.detect().accelerator in ("cpu", "cuda", "xpu", "mps")


def test_read_model_config_and_class(toy_models, tmp_path):
    cfg = read_model_config(toy_models["gemma2"])
    assert cfg.model_type == "gemma2" and cfg.attn_logit_softcapping == 50.0
    assert read_model_config(str(tmp_path / "missing")) is None
    assert read_model_config(None) is None
    assert (
        resolve_model_class("reward", toy_models["qwen2-rm"], read_model_config(toy_models["qwen2-rm"])).__name__
        == "Qwen2ForSequenceClassification"
    )
    assert (
        resolve_model_class("dpo", toy_models["qwen2"], read_model_config(toy_models["qwen2"])).__name__
        == "Qwen2ForCausalLM"
    )
    assert resolve_model_class("dpo", "x", None) is None


# --------------------------------------------------------------------------------------------------------------------
# Safety settings
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config_class", [RewardConfig, DPOConfig, KTOConfig, GRPOConfig])
def test_unknown_rule_id_in_config_lists_valid_ids(config_class):
    extra = dict(num_generations=2, per_device_train_batch_size=2) if config_class is GRPOConfig else {}
    with pytest.raises(ValueError, match=r"unknown rule ids \['nope'\]\. Valid ids are: ") as exc:
        config_class(output_dir=OUT, use_cpu=True, safety_disable_rules=["nope", "optim.grad_clip"], **extra)
    for rule_id in EXPECTED_IDS:
        assert rule_id in str(exc.value)


def test_unknown_rule_id_from_config_object():
    class Launcher:
        safety_disable_rules = ["precision.bf16_over_fp16", "nope", "also.nope"]

    with pytest.raises(
        ValueError,
        match=r"unknown rule ids \['also.nope', 'nope'\]\. Valid ids are: .*precision.fp32_trainable_params",
    ):
        SafetyArguments.from_config(Launcher())


def test_from_config_defaults_for_plain_trl_config():
    s = SafetyArguments.from_config(trl.DPOConfig(output_dir=OUT, use_cpu=True))
    assert isinstance(s, SafetyArguments)
    assert (s.safety_mode, s.safety_disable_rules, s.nan_guard, s.nan_snapshot_steps) == ("fix", [], True, 10)
    # each call gets its own list
    s.safety_disable_rules.append("optim.grad_clip")
    assert SafetyArguments.from_config(object()).safety_disable_rules == []


def test_from_config_reads_safety_fields_and_splits_strings():
    class Launcher:
        safety_mode = "strict"
        safety_disable_rules = "optim.grad_clip, logging.show_nonfinite"
        nan_guard = False

    s = SafetyArguments.from_config(Launcher())
    assert s.safety_mode == "strict" and s.nan_guard is False
    assert s.safety_disable_rules == ["optim.grad_clip", "logging.show_nonfinite"]
    assert DPOConfig(output_dir=OUT, use_cpu=True, safety_disable_rules="optim.grad_clip").safety_disable_rules == [
        "optim.grad_clip"
    ]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("safety_mode", "loud", r"`safety_mode` must be one of \['fix', 'warn', 'strict', 'off'\], got 'loud'"),
        ("nan_snapshot_steps", 0, r"`nan_snapshot_steps` must be an integer >= 1, got 0"),
        ("nan_max_rollbacks", -1, r"`nan_max_rollbacks` must be an integer >= 0"),
        ("nan_max_consecutive_skips", 0, r"`nan_max_consecutive_skips` must be an integer >= 1"),
        ("nan_lr_backoff", 0.0, r"`nan_lr_backoff` must be in \(0, 1\], got 0.0"),
        ("nan_lr_backoff", 1.5, r"`nan_lr_backoff` must be in \(0, 1\]"),
        ("nan_spike_factor", 0.5, r"`nan_spike_factor` must be 0 \(off\) or > 1"),
        ("nan_spike_patience", 0, r"`nan_spike_patience` must be an integer >= 1"),
    ],
)
def test_invalid_safety_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        DPOConfig(output_dir=OUT, use_cpu=True, **{field: value})
    with pytest.raises(ValueError, match=match):
        SafetyArguments(**{field: value})


def test_safety_fields_defaults_on_every_config():
    for kind in TRAINER_KINDS:
        args = make_args(kind)
        assert isinstance(args, SafetyArguments)
        assert (args.safety_mode, args.safety_disable_rules, args.nan_guard) == ("fix", [], True)


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


def test_safety_error_is_a_value_error():
    findings = [Finding("a.rule", "blocked", "first problem"), Finding("b.rule", "blocked", "second problem")]
    err = SafetyError(findings)
    assert isinstance(err, ValueError)
    assert err.findings == tuple(findings)
    lines = str(err).splitlines()
    assert lines[0] == "safe_trainers refused this configuration (2 problems):"
    assert lines[1:3] == ["  [a.rule] first problem", "  [b.rule] second problem"]
    assert "safety_disable_rules" in lines[3]
    assert str(SafetyError(findings[:1])).startswith("safe_trainers refused this configuration (1 problem):")
    assert str(SafetyError(findings[:1], header="custom header")).startswith("custom header\n  [a.rule] first problem")
    with pytest.raises(ValueError, match="first problem"):
        raise err


def test_training_diverged_error_is_a_runtime_error():
    err = TrainingDivergedError("diverged", checkpoint_dir="ckpt", report_path="events.jsonl")
    assert isinstance(err, RuntimeError) and not isinstance(err, ValueError)
    assert (str(err), err.checkpoint_dir, err.report_path) == ("diverged", "ckpt", "events.jsonl")


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


def _sample_report():
    return SafetyReport(
        trainer="dpo",
        mode="fix",
        findings=[
            Finding("optim.grad_clip", "skipped", "disabled by `safety_disable_rules`."),
            Finding(
                "precision.bf16_over_fp16",
                "fixed",
                "fp16 switched to bf16.",
                (
                    Change("args.fp16", True, False),
                    Change("args.model_init_kwargs.dtype", REMOVED, "bfloat16"),
                    Change("args.model_init_kwargs.torch_dtype", torch.float16, REMOVED),
                ),
                {"internal": object()},
            ),
            Finding("logging.show_nonfinite", "warned", "would turn the filter off."),
        ],
    )


def test_report_render():
    text = _sample_report().render()
    lines = text.splitlines()
    assert lines[0] == "safe_trainers (dpo, safety_mode='fix'): 1 fixed, 1 warned, 1 skipped."
    assert any(line.startswith("  [skipped] optim.grad_clip") for line in lines)
    assert any(
        line.startswith("  [fixed] precision.bf16_over_fp16") and "fp16 switched to bf16." in line for line in lines
    )
    assert any(line.strip() == "args.fp16: True -> False" for line in lines)
    assert any(line.strip() == "args.model_init_kwargs.dtype: <removed> -> 'bfloat16'" for line in lines)
    assert any(line.strip() == "args.model_init_kwargs.torch_dtype: torch.float16 -> <removed>" for line in lines)
    assert lines[-1].startswith("  Disable a rule with `safety_disable_rules=[<rule id>]`")


def test_report_render_empty_and_off():
    assert SafetyReport("kto", "fix").render() == "safe_trainers (kto): all safety rules passed, nothing changed."
    off = SafetyReport("grpo", "off", [Finding("x", "fixed", "ignored")])
    assert off.render() == 'safe_trainers (grpo): safety rules are off (`safety_mode="off"`).'


def test_change_render_truncates_long_values():
    text = Change("args.model_init_kwargs.x", "a" * 200, 1).render()
    old = text.split(": ", 1)[1].split(" -> ")[0]
    assert len(old) == 80 and old.endswith("...")


def test_report_views():
    report = _sample_report()
    assert [f.action for f in report.by_rule("precision.bf16_over_fp16")] == ["fixed"]
    assert report.by_rule("nope") == []
    assert [c.path for c in report.changes] == [
        "args.fp16",
        "args.model_init_kwargs.dtype",
        "args.model_init_kwargs.torch_dtype",
    ]


def test_report_write_json(tmp_path):
    out = tmp_path / "new" / "dir"
    path = _sample_report().write_json(str(out))
    assert path == os.path.join(str(out), "safety_report.json")
    assert sorted(os.listdir(out)) == ["safety_report.json"]  # no temporary file left behind
    data = json.loads(open(path).read())
    assert data["trainer"] == "dpo" and data["mode"] == "fix"
    assert [f["rule_id"] for f in data["findings"]] == [
        "optim.grad_clip",
        "precision.bf16_over_fp16",
        "logging.show_nonfinite",
    ]
    fixed = data["findings"][1]
    assert fixed["action"] == "fixed" and fixed["message"] == "fp16 switched to bf16."
    assert fixed["changes"] == [
        {"path": "args.fp16", "old": True, "new": False},
        {"path": "args.model_init_kwargs.dtype", "old": "<removed>", "new": "bfloat16"},
        {"path": "args.model_init_kwargs.torch_dtype", "old": "torch.float16", "new": "<removed>"},
    ]
    assert "data" not in fixed  # internal detail stays out of the report
    # a second write replaces the file and can use another name
    assert SafetyReport("dpo", "warn").write_json(str(out)) == path
    assert json.loads(open(path).read()) == {"trainer": "dpo", "mode": "warn", "findings": []}
    other = SafetyReport("kto", "fix").write_json(str(out), filename="other.json")
    assert os.path.basename(other) == "other.json"


def test_finding_to_dict_jsonable_values():
    finding = Finding("x", "fixed", "m", (Change("a", {"k": (1, 2)}, [torch.float16, None]),))
    assert finding.to_dict()["changes"] == [{"path": "a", "old": {"k": [1, 2]}, "new": ["torch.float16", None]}]
    json.dumps(finding.to_dict())
