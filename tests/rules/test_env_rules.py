"""`env.cublas_sigfpe` (the H20 + cuBLAS < 12.4.5.8 SIGFPE in half precision) and the `Hardware` facts the rules read:
a named GPU's capability, a target machine, this machine."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from safe_trainers.rules import get_rule
from safe_trainers.rules.hardware import Hardware, cublas_at_risk, gpu_capability, run_cublas_probe, version_tuple

from rule_utils import CPU, make_args, make_setup  # tests/ is on sys.path, as for conftest


CUBLAS = get_rule("env.cublas_sigfpe")


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
