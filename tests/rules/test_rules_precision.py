"""Pure tests of the precision and hardware rules: fp16 from accelerate and from the weights themselves, bf16 on
hardware without it, the H20 cuBLAS SIGFPE, the learning rate of full fine-tuning, and the `Hardware` facts.

Hardware facts are inputs (`Hardware(...)` / `Hardware.target(...)`), so every decision is tested on this CPU machine.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from peft import LoraConfig, get_peft_model

from safe_trainers.rules.hardware import Hardware, gpu_capability, run_cublas_probe
from safe_trainers.rules import get_rule
from safe_trainers.rules.hardware import cublas_at_risk, version_tuple
from safe_trainers.rules.precision import checkpoint_dtype, dtype_name, load_dtype
from safe_trainers.testing.toy import build_model, model_config

from rule_utils import CPU, CUDA_BF16, CUDA_NO_BF16, change_map, make_args, make_setup, run_setup_stage


PREFER_BF16 = get_rule("precision.bf16_over_fp16")
BF16_SUPPORTED = get_rule("precision.bf16_supported")
CUBLAS = get_rule("env.cublas_sigfpe")
LEARNING_RATE = get_rule("optim.learning_rate")


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
# env.cublas_sigfpe: H20 + cuBLAS < 12.4.5.8 + half precision
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, cuda, cublas, risk",
    [
        ("NVIDIA H20", "12.1", None, "risky"),
        ("NVIDIA H20", "12.1", "12.1.3.1", "risky"),
        ("NVIDIA H20", "12.1", "12.4.5.8", None),  # a fixed cuBLAS wheel in a cu121 torch
        ("NVIDIA H20", "12.4", None, None),
        ("NVIDIA H20", "12.6", "12.6.4.1", None),
        ("NVIDIA H20", "11.8", None, "unverified"),
        ("NVIDIA H20", None, None, "unverified"),
        ("NVIDIA H200", "12.1", "12.1.3.1", None),  # "H20" must not match the H200
        ("NVIDIA H100 80GB HBM3", "12.1", "12.1.3.1", None),
        (None, "12.1", None, None),
    ],
)
def test_cublas_at_risk(name, cuda, cublas, risk):
    assert cublas_at_risk(name, cuda, cublas) == risk


def h20(cuda="12.1", cublas=None, probe=None):
    return Hardware(
        accelerator="cuda", bf16_supported=True, device_name="NVIDIA H20", cuda_version=cuda,
        cublas_version=cublas, cublas_probe=probe,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["grpo", "dpo"])
@pytest.mark.parametrize("probe", [None, "crashed"])
def test_cublas_sigfpe_blocked_on_h20_with_cuda_12_1(kind, probe):
    finding = CUBLAS.check(make_setup(kind, "qwen2", hardware=h20(probe=probe), args=make_args(kind, bf16=True)))
    assert finding.action == "blocked"
    assert "`bf16=True` on NVIDIA H20 with CUDA 12.1" in finding.message
    assert "nvidia-cublas-cu12>=12.4.5.8" in finding.message and "CUDA >= 12.4" in finding.message
    assert ("died with SIGFPE" in finding.message) == (probe == "crashed")


def test_cublas_sigfpe_probe_passed_is_a_warning():
    finding = CUBLAS.check(make_setup("grpo", "qwen2", hardware=h20(probe="passed"), args=make_args("grpo", bf16=True)))
    assert finding.action == "warned" and "other shapes may still" in finding.message


def test_cublas_sigfpe_half_weights_without_amp():
    args = make_args("dpo", bf16=False, model_init_kwargs={"dtype": "bfloat16"})
    finding = CUBLAS.check(make_setup("dpo", "qwen2", hardware=h20(), args=args))
    assert finding.action == "blocked" and "bfloat16 weights" in finding.message


@pytest.mark.parametrize(
    "hardware, args_kw",
    [
        (h20(), dict(bf16=False)),  # fp32: the reporter's "bf16=False works"
        (h20(cublas="12.4.5.8"), dict(bf16=True)),
        (h20(cuda="12.4"), dict(bf16=True)),
        (Hardware.target("H100", cuda_version="12.1"), dict(bf16=True)),
        (CPU, dict(bf16=True)),
    ],
)
def test_cublas_sigfpe_silent(hardware, args_kw):
    assert CUBLAS.check(make_setup("grpo", "qwen2", hardware=hardware, args=make_args("grpo", **args_kw))) is None


def test_cublas_sigfpe_unknown_version_warned():
    finding = CUBLAS.check(make_setup("grpo", "qwen2", hardware=h20(cuda=None), args=make_args("grpo", bf16=True)))
    assert finding.action == "warned" and "not verified" in finding.message


def test_cublas_probe_runs_in_a_subprocess_and_reports_sigfpe():
    # the probe mechanism, on CPU: a child killed by SIGFPE is "crashed", this process lives on
    assert run_cublas_probe("import os, signal; os.kill(os.getpid(), signal.SIGFPE)") == "crashed"
    assert run_cublas_probe("pass") == "passed"
    assert run_cublas_probe("raise SystemExit(3)") == "failed"
    assert os.getpid() and signal.SIGFPE  # still here


# --------------------------------------------------------------------------------------------------------------------
# Hardware facts
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, capability",
    [("NVIDIA H20", (9, 0)), ("NVIDIA H200", (9, 0)), ("Tesla V100-SXM2-32GB", (7, 0)), ("NVIDIA A10G", (8, 6)),
     ("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA L40S", (8, 9)), ("Tesla T4", (7, 5)), ("Mystery GPU", None)],
)  # fmt: skip
def test_gpu_capability(name, capability):
    assert gpu_capability(name) == capability


def test_hardware_target():
    assert not Hardware.target("V100").bf16_supported and Hardware.target("h100").bf16_supported
    target = Hardware.target("H20", cuda_version="12.1", cublas_version="12.1.3.1")
    assert (target.device_name, target.accelerator) == ("NVIDIA H20", "cuda")
    assert target.source == "NVIDIA H20 (bf16: yes, CUDA 12.1, cuBLAS 12.1.3.1)"
    assert Hardware.target("cpu").accelerator == "cpu"
    assert Hardware.target("Mystery GPU", bf16_supported=False).bf16_supported is False
    with pytest.raises(ValueError, match="unknown GPU 'Mystery GPU'.*--bf16-supported"):
        Hardware.target("Mystery GPU")
    assert version_tuple("12.4.5.8") == (12, 4, 5, 8) and version_tuple("2.5.1+cu121") == (2, 5, 1)


def test_hardware_detect_on_this_machine():
    facts = Hardware.detect()
    assert facts.source == "this machine" and facts.cublas_probe is None
    if not torch.cuda.is_available():
        assert (facts.accelerator, facts.bf16_supported, facts.device_name) == ("cpu", True, None)


# --------------------------------------------------------------------------------------------------------------------
# optim.learning_rate
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo"])
def test_learning_rate_of_full_finetuning_warned(kind):
    finding = LEARNING_RATE.check(make_setup(kind, "qwen2", args=make_args(kind, learning_rate=1e-4)))
    assert finding.action == "warned" and "`learning_rate=0.0001` while training every weight" in finding.message


@pytest.mark.parametrize(
    "kind, lr, lora",
    [("dpo", 1e-6, False), ("dpo", 1e-5, False), ("dpo", 1e-4, True), ("grpo", 5e-6, False), ("reward", 1e-4, False)],
)
def test_learning_rate_silent(kind, lr, lora):
    peft_config = LoraConfig(target_modules=["q_proj"]) if lora else None
    setup = make_setup(kind, "qwen2", args=make_args(kind, learning_rate=lr), peft_config=peft_config)
    assert LEARNING_RATE.check(setup) is None if kind in LEARNING_RATE.trainers else kind not in LEARNING_RATE.trainers


def test_learning_rate_silent_for_a_peft_model_instance():
    model = get_peft_model(build_model("qwen2"), LoraConfig(target_modules=["q_proj"], r=2))
    setup = make_setup("dpo", "qwen2", model=model, args=make_args("dpo", learning_rate=1e-4))
    assert LEARNING_RATE.check(setup) is None
