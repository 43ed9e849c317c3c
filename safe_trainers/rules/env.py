"""Environment rule (`env.*`): no half-precision GEMM on the H20 + cuBLAS 12.1 SIGFPE bug.

It decides from the [`Hardware`] facts in the setup (this machine, or the target named to `safe-trainers check`), so
it is pure and testable anywhere.
"""

from __future__ import annotations

from .hardware import cublas_at_risk
from .report import Finding
from .base import Rule
from .precision import launcher_precision, load_dtype, parameter_dtypes


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


class CublasSigfpe(Rule):
    """bf16/fp16 on an H20 with a cuBLAS before 12.4.5.8 (SIGFPE in cublasLt) is refused, with the upgrade.

    What it changes:
        bf16/fp16 (AMP or half weights) on an NVIDIA H20 whose cuBLAS is older than 12.4.5.8 (the `nvidia-cublas-cu12`
        wheel, else `torch.version.cuda` < 12.4) is blocked with the fix (`pip install 'nvidia-cublas-cu12>=12.4.5.8'`,
        or a torch built for CUDA >= 12.4); on such a machine the known crashing GEMM is first run in a subprocess: if
        it passes, a warning instead; CUDA 11 or unknown versions are warned.

    Why:
        cublasLt divides by zero in its heuristic for some half-precision GEMM shapes: "Floating point exception (core
        dumped)" ([trl#2906](https://github.com/huggingface/trl/issues/2906),
        [pytorch#133548](https://github.com/pytorch/pytorch/issues/133548)); fp32 works at twice the memory, so it is
        not applied automatically.

    Opt out:
        `safety_disable_rules=["env.cublas_sigfpe"]`.
    """

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
