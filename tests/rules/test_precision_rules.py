"""The precision rules: `precision.bf16_over_fp16` (fp16 asked for in the config, by accelerate, or by the weights
themselves), `precision.fp32_trainable_params` and `precision.bf16_supported`.

Hardware facts are inputs (`Hardware(...)`), so every decision is tested on this CPU machine.
"""

from __future__ import annotations

import re

import pytest
import torch
from peft import LoraConfig, get_peft_model

from safe_trainers import KTOConfig, DPOConfig, DPOTrainer
from safe_trainers.rules import BuiltTrainer, get_rule
from safe_trainers.rules.hardware import Hardware
from safe_trainers.rules.precision import (
    FP16_OVERFLOW_FAMILIES, checkpoint_dtype, dtype_name, is_fp16, load_dtype, requested_dtype,
)  # fmt: skip
from safe_trainers.rules.report import REMOVED
from safe_trainers.testing.toy import build_model, model_config

from rule_utils import (  # tests/ is on sys.path, as for conftest
    CPU, CUDA_BF16, CUDA_NO_BF16, change_map, make_args, make_setup, run_setup_stage,
)  # fmt: skip
from transformers import AutoModelForCausalLM
from trainer_utils import DEFAULT_MODEL, actions, train_losses  # tests/ is on sys.path, as for conftest
from safe_trainers.kinds import TRAINER_KINDS
from safe_trainers.testing.build import build_trainer, preset_args
from safe_trainers.testing.toy import dataset_for
import math


BF16_SUPPORTED = get_rule("precision.bf16_supported")
PREFER_BF16 = get_rule("precision.bf16_over_fp16")


# --------------------------------------------------------------------------------------------------------------------
# precision.bf16_over_fp16
# --------------------------------------------------------------------------------------------------------------------


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


@pytest.fixture
def accelerate_fp16(monkeypatch):
    """What `accelerate launch --mixed_precision fp16` (or its config file) passes to the training process."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")


# --------------------------------------------------------------------------------------------------------------------
# precision.bf16_over_fp16: fp16 chosen by accelerate
# --------------------------------------------------------------------------------------------------------------------


def test_accelerate_fp16_switched_to_bf16(accelerate_fp16):
    args = make_args("dpo", bf16=False)
    assert (args.fp16, args.bf16, args.mixed_precision) == (False, False, "fp16")  # what the trainer would use
    finding = PREFER_BF16.check(make_setup("dpo", "llama", args=args))
    assert finding.action == "fixed" and "`accelerate launch --mixed_precision fp16`" in finding.message
    assert change_map(finding) == {"args.bf16": (False, True), "args.mixed_precision": ("fp16", "bf16")}
    new, _ = run_setup_stage(make_setup("dpo", "llama", args=args))
    assert (new.args.bf16, new.args.mixed_precision) == (True, "bf16")


def test_accelerate_fp16_without_bf16_on_an_overflowing_family_trains_in_fp32(accelerate_fp16):
    args = make_args("dpo", bf16=False, max_grad_norm=0.0)
    new, report = run_setup_stage(make_setup("dpo", "gemma2", hardware=CUDA_NO_BF16, args=args))
    assert change_map(report.by_rule("precision.bf16_over_fp16")[0]) == {"args.mixed_precision": ("fp16", "no")}
    # the later `optim.grad_clip` fix copied the config again: the fp32 choice survives the copy
    assert (new.args.max_grad_norm, new.args.mixed_precision) == (1.0, "no")


@pytest.mark.parametrize("env, bf16", [("fp16", True), ("bf16", False), ("no", False)])
def test_accelerate_precision_silent_when_not_fp16(monkeypatch, env, bf16):
    # explicit flags win over accelerate's choice (`bf16=True` trains in bf16); bf16 or no mixed precision is fine
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", env)
    assert PREFER_BF16.check(make_setup("dpo", "llama", args=make_args("dpo", bf16=bf16))) is None


# --------------------------------------------------------------------------------------------------------------------
# precision.bf16_over_fp16: fp16 weights (instances, `dtype="auto"` on an fp16 checkpoint)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp16_gemma2():
    return build_model("gemma2").to(torch.float16)


@pytest.mark.parametrize("hardware, target", [(CPU, "bfloat16"), (CUDA_NO_BF16, "float32")])
def test_fp16_instance_cast_before_construction(fp16_gemma2, hardware, target):
    setup = make_setup("dpo", "gemma2", model=fp16_gemma2, hardware=hardware, args=make_args("dpo"))
    finding = PREFER_BF16.check(setup)
    assert finding.action == "fixed" and "the model passed in has fp16 weights" in finding.message
    assert change_map(finding)["model.dtype"] == ("float16", target)


def test_fp16_instance_cast_keeps_fp32_adapter_weights():
    model = get_peft_model(build_model("gemma2").to(torch.float16), LoraConfig(target_modules=["q_proj"], r=2))
    lora = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert lora  # PEFT upcast the adapter
    run_setup_stage(make_setup("dpo", "gemma2", model=model, args=make_args("dpo")))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {dtypes[n] for n in lora} == {torch.float32}
    assert set(dtypes.values()) == {torch.float32, torch.bfloat16}


def test_fp16_ref_model_instance_cast(fp16_gemma2):
    policy = build_model("gemma2")
    setup = make_setup("dpo", "gemma2", model=policy, ref_model=fp16_gemma2, args=make_args("dpo"))
    assert change_map(PREFER_BF16.check(setup)) == {"ref_model.dtype": ("float16", "bfloat16")}


@pytest.mark.parametrize(
    "mik, stored, expected",
    [
        ({"dtype": "auto"}, "float16", {"args.model_init_kwargs.dtype": ("auto", "bfloat16")}),
        ({"dtype": None}, "float16", {"args.model_init_kwargs.dtype": (None, "bfloat16")}),
        ({"dtype": "auto"}, "bfloat16", None),
        ({"dtype": "auto"}, "float32", None),
        ({}, "float16", None),  # TRL loads float32 when no dtype is given
    ],
)
def test_auto_dtype_on_an_fp16_checkpoint(mik, stored, expected):
    config = model_config("gemma2", dtype=stored)
    finding = PREFER_BF16.check(make_setup("dpo", "gemma2", config=config, args=make_args("dpo", model_init_kwargs=mik)))
    if expected is None:
        assert finding is None
    else:
        assert change_map(finding) == expected and "stored in float16" in finding.message


def test_bf16_instance_is_not_fp16():
    setup = make_setup("dpo", "gemma2", model=build_model("gemma2").to(torch.bfloat16), args=make_args("dpo"))
    assert PREFER_BF16.check(setup) is None


def test_dtype_helpers():
    assert [dtype_name(v) for v in ("half", "BF16", torch.float32, "auto", "int8", None)] == [
        "float16", "bfloat16", "float32", "auto", None, None,
    ]  # fmt: skip
    assert checkpoint_dtype(model_config("qwen2", dtype="float16")) == "float16"
    assert checkpoint_dtype(None) is None
    assert load_dtype({}, None) == (None, "float32")
    assert load_dtype({"torch_dtype": "auto"}, model_config("qwen2", dtype="bfloat16")) == ("auto", "bfloat16")


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
# precision.bf16_supported
# --------------------------------------------------------------------------------------------------------------------

V100 = Hardware.target("V100", cuda_version="12.4")
A100 = Hardware.target("A100", cuda_version="12.4")


@pytest.mark.parametrize(
    "family, args_kw, fragment",
    [
        ("llama", dict(bf16=True), "fp16 mixed precision"),
        ("gemma2", dict(bf16=True), "fp32 (`bf16=False`): `gemma2` overflows fp16"),
        ("llama", dict(bf16=False, model_init_kwargs={"dtype": "bfloat16"}), "model_init_kwargs['dtype']"),
    ],
)
def test_bf16_on_a_gpu_without_bf16_warned(family, args_kw, fragment):
    finding = BF16_SUPPORTED.check(make_setup("dpo", family, hardware=V100, args=make_args("dpo", **args_kw)))
    assert finding.action == "warned" and "NVIDIA V100" in finding.message and fragment in finding.message


@pytest.mark.parametrize("hardware", [A100, CPU, CUDA_BF16])
def test_bf16_supported_silent_where_bf16_has_hardware(hardware):
    assert BF16_SUPPORTED.check(make_setup("dpo", "llama", hardware=hardware, args=make_args("dpo", bf16=True))) is None


def test_bf16_supported_silent_without_a_bf16_request():
    assert BF16_SUPPORTED.check(make_setup("dpo", "llama", hardware=V100, args=make_args("dpo", bf16=False))) is None


# --------------------------------------------------------------------------------------------------------------------
# On a real safe trainer, built (and where the claim needs it, trained) from a tiny model
# --------------------------------------------------------------------------------------------------------------------


def test_dpo_fp16_on_gemma2_becomes_bf16(toy_models, tmp_path):
    args = DPOConfig(**preset_args("dpo", tmp_path / "out", fp16=True))
    trainer = DPOTrainer(model=toy_models["gemma2"], args=args, train_dataset=dataset_for("dpo", 8))
    assert trainer.args.bf16 is True and trainer.args.fp16 is False
    assert args.fp16 is True and args.bf16 is False  # the user's config object is untouched
    (finding,) = trainer.safety_report.by_rule("precision.bf16_over_fp16")
    assert finding.action == "fixed" and "`gemma2` activations overflow" in finding.message
    assert {(c.path, c.old, c.new) for c in finding.changes} >= {
        ("args.fp16", True, False),
        ("args.bf16", False, True),
    }
    assert trainer.accelerator.mixed_precision == "bf16"
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the `use_cpu` fix is for machines without an accelerator")
def test_fp16_on_cpu_without_use_cpu_sets_use_cpu(toy_models, tmp_path):
    trainer = build_trainer("kto", toy_models["qwen2"], tmp_path, fp16=True, use_cpu=False)
    assert (trainer.args.fp16, trainer.args.bf16, trainer.args.use_cpu) == (False, True, True)
    changes = {c.path: c.new for c in trainer.safety_report.changes}
    assert changes["args.use_cpu"] is True


def test_fp16_load_dtype_becomes_bf16_and_torch_dtype_is_renamed(toy_models, tmp_path):
    trainer = build_trainer("kto", toy_models["qwen2"], tmp_path, model_init_kwargs={"torch_dtype": "float16"})
    assert trainer.args.model_init_kwargs == {"dtype": "bfloat16"}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert actions(trainer)["precision.bf16_over_fp16"] == "fixed"


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_precision_rule_quiet_without_fp16(kind, toy_models, tmp_path):
    trainer = build_trainer(kind, toy_models[DEFAULT_MODEL[kind]], tmp_path, rows=4)
    assert "precision.bf16_over_fp16" not in actions(trainer)
    assert "precision.fp32_trainable_params" not in actions(trainer)
    assert trainer.args.fp16 is False
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}


def test_full_finetune_fp16_instance_is_upcast(toy_models, tmp_path):
    # with `precision.bf16_over_fp16` off the fp16 weights stay, and this rule upcasts the trainable ones
    model = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"], dtype=torch.float16)
    trainer = build_trainer("dpo", model, tmp_path, safety_disable_rules=["precision.bf16_over_fp16"])
    (finding,) = trainer.safety_report.by_rule("precision.fp32_trainable_params")
    assert finding.action == "fixed"
    assert len(finding.data["names"]) == len(list(trainer.model.parameters()))
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert all(math.isfinite(loss) for loss in train_losses(trainer))
