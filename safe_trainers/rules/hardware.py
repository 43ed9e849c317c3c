"""Hardware rules: bf16 only where the GPU has it, and no half-precision GEMM on the H20 + cuBLAS 12.1 SIGFPE bug.

Both decide from the [`Hardware`] facts in the setup (this machine, or the target named to `safe-trainers check`), so
they are pure and testable anywhere.
"""

from __future__ import annotations

from ..hardware import cublas_at_risk
from ..report import Finding
from .base import Rule
from .precision import FP16_OVERFLOW_FAMILIES, launcher_precision, load_dtype, parameter_dtypes


CUBLAS_FIX = (
    "`pip install 'nvidia-cublas-cu12>=12.4.5.8'` (the wheel torch loads), or a torch built for CUDA >= 12.4 "
    "(e.g. `pip install torch --index-url https://download.pytorch.org/whl/cu124`)"
)


def half_precision_in_use(setup) -> list[str]:
    """How the run computes in bf16/fp16 (AMP flags, accelerate, DeepSpeed, half weights), as the user set it."""
    args = setup.args
    found = [f"`{flag}=True`" for flag in ("bf16", "fp16") if getattr(args, flag, False)]
    launcher = launcher_precision(args)
    if launcher in ("fp16", "bf16"):
        found.append(f"accelerate's `mixed_precision={launcher!r}`")
    ds = setup.deepspeed_config or {}
    found += [f'DeepSpeed `"{key}"`' for key in ("bf16", "fp16") if (ds.get(key) or {}).get("enabled") is True]
    if setup.model_is_path:
        resolved = load_dtype(setup.model_init_kwargs, setup.model_config)[1]
        if resolved in ("bfloat16", "float16"):
            found.append(f"{resolved} weights")
    else:
        found += [f"{name} weights" for name in sorted(parameter_dtypes(setup.model) & {"bfloat16", "float16"})]
    return found


def bf16_requests(setup) -> list[str]:
    """Where bf16 is asked for: the flag, accelerate, DeepSpeed's section, or the load dtype of a path."""
    args = setup.args
    found = ["`bf16=True`"] if args.bf16 else []
    if launcher_precision(args) == "bf16":
        found.append("accelerate's `mixed_precision='bf16'`")
    if ((setup.deepspeed_config or {}).get("bf16") or {}).get("enabled") is True:
        found.append('DeepSpeed `"bf16": {"enabled": true}`')
    if setup.model_is_path and load_dtype(setup.model_init_kwargs, setup.model_config)[0] == "bfloat16":
        found.append("`model_init_kwargs['dtype']='bfloat16'`")
    return found


class Bf16Supported(Rule):
    id = "precision.bf16_supported"
    summary = "bf16 asked for on a GPU without bf16 hardware (before Ampere: emulated, several times slower): warned."
    rationale = "https://github.com/axolotl-ai-cloud/axolotl/blob/main/src/axolotl/utils/schemas/config.py"

    def check(self, setup) -> Finding | None:
        hw = setup.hardware
        requests = bf16_requests(setup)
        if hw.bf16_supported or hw.accelerator != "cuda" or not requests:
            return None
        overflow = sorted(setup.model_types & FP16_OVERFLOW_FAMILIES)
        alternative = (
            f"fp32 (`bf16=False`): `{overflow[0]}` overflows fp16"
            if overflow
            else "fp16 mixed precision (`fp16=True`, `bf16=False`; weights stay fp32), or fp32 (`bf16=False`)"
        )
        return self.warned(
            f"{' and '.join(requests)} on {hw.device_name or 'this GPU'}, which has no bf16 hardware (compute "
            f"capability < 8.0): torch emulates bf16, so training runs several times slower. Use {alternative}."
        )


class CublasSigfpe(Rule):
    id = "env.cublas_sigfpe"
    summary = "bf16/fp16 on an H20 with a cuBLAS before 12.4.5.8 (SIGFPE in cublasLt) is refused, with the upgrade."
    rationale = "https://github.com/huggingface/trl/issues/2906"

    def check(self, setup) -> Finding | None:
        hw = setup.hardware
        risk = cublas_at_risk(hw.device_name, hw.cuda_version, hw.cublas_version)
        half = half_precision_in_use(setup)
        if risk is None or not half:
            return None
        versions = f"cuBLAS {hw.cublas_version}" if hw.cublas_version else f"CUDA {hw.cuda_version or '(unknown)'}"
        workaround = "Until then fp32 avoids it (`bf16=False`, `fp16=False`, float32 weights), at twice the memory."
        if risk == "unverified":
            return self.warned(
                f"{' and '.join(half)} on {hw.device_name} with {versions}: half-precision GEMMs on H20 crash with "
                "'Floating point exception' (SIGFPE in cublasLt) with cuBLAS before 12.4.5.8, and this version was "
                f"not verified. Make sure torch loads a fixed cuBLAS: {CUBLAS_FIX}."
            )
        if hw.cublas_probe == "passed":
            return self.warned(
                f"{' and '.join(half)} on {hw.device_name} with {versions}: this cuBLAS has the H20 SIGFPE bug; the "
                f"known crashing GEMM ran here, but other shapes may still kill the run. Upgrade: {CUBLAS_FIX}."
            )
        seen = ""
        if hw.cublas_probe == "crashed":
            seen = " (the known crashing GEMM was run in a subprocess and died with SIGFPE)"
        return self.blocked(
            f"{' and '.join(half)} on {hw.device_name} with {versions}: half-precision GEMMs on H20 kill the process "
            f"with 'Floating point exception (core dumped)', an integer division by zero inside cublasLt before "
            f"cuBLAS 12.4.5.8{seen}. Fix: {CUBLAS_FIX}. {workaround}"
        )
