"""`Hardware`: the facts about the machine a run trains on, detected here or stated for a target (`safe-trainers check`).

Rules never ask the machine themselves: they read a `Hardware` value, so every hardware-dependent decision is a pure
function of these facts and can be tested on any machine. `Hardware.detect()` reads this machine (the only place that
calls torch's device queries, and the only place that may run the cuBLAS probe); `Hardware.target()` builds the facts
for a GPU named on the command line, from a table.
"""

from __future__ import annotations

import importlib.metadata
import re
import signal
import subprocess
import sys
from dataclasses import dataclass


# GPUs by the name fragment `torch.cuda.get_device_name()` reports, with their compute capability. bf16 has hardware
# support from compute capability 8.0 (Ampere); before it, torch emulates bf16 (slowly).
KNOWN_GPUS: dict[str, tuple[int, int]] = {
    "V100": (7, 0), "T4": (7, 5), "RTX 2080": (7, 5), "A100": (8, 0), "A800": (8, 0), "A30": (8, 0),
    "A10": (8, 6), "A10G": (8, 6), "A40": (8, 6), "A6000": (8, 6), "RTX 3090": (8, 6), "L4": (8, 9),
    "L40": (8, 9), "L40S": (8, 9), "RTX 4090": (8, 9), "H100": (9, 0), "H800": (9, 0), "H20": (9, 0),
    "H200": (9, 0), "GH200": (9, 0), "B200": (10, 0), "GB200": (10, 0),
}  # fmt: skip
BF16_MIN_CAPABILITY = (8, 0)
# A bf16 GEMM that crashes with SIGFPE ("integer divide by zero" in cublasLt's heuristic) on H20 with CUDA 12.1-era
# cuBLAS (pytorch#133548). Run only in a subprocess: a SIGFPE kills the process that runs it.
CUBLAS_PROBE_CODE = (
    "import torch\n"
    "layer = torch.nn.Linear(1024, 18432, device='cuda', dtype=torch.bfloat16)\n"
    "layer(torch.randn(2, 1024, device='cuda', dtype=torch.bfloat16))\n"
    "torch.cuda.synchronize()\n"
)


H20_NAME = re.compile(r"(?<![A-Z0-9])H20(?![A-Z0-9])", re.IGNORECASE)  # "NVIDIA H20", not "H200"
FIXED_CUBLAS = (12, 4, 5, 8)  # nvidia-cublas-cu12 12.4.5.8, the release torch's cu124 wheels ship
FIXED_CUDA = (12, 4)


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """`"12.4.5.8"` -> `(12, 4, 5, 8)`; `None` for a missing or unreadable version."""
    if not text:
        return None
    parts = re.findall(r"\d+", text.split("+")[0])
    return tuple(int(p) for p in parts) or None


def cublas_at_risk(device_name: str | None, cuda_version: str | None, cublas_version: str | None) -> str | None:
    """Whether half-precision GEMMs can die with SIGFPE here: `"risky"` (H20 with a cuBLAS before 12.4.5.8),
    `"unverified"` (H20 with a CUDA 11 cuBLAS, not reported either way, or no version known), `None` (safe)."""
    if not device_name or not H20_NAME.search(device_name):
        return None
    cublas, cuda = version_tuple(cublas_version), version_tuple(cuda_version)
    if cublas is not None:
        fixed, major = cublas >= FIXED_CUBLAS, cublas[0]
    elif cuda is not None:
        fixed, major = cuda >= FIXED_CUDA, cuda[0]
    else:
        return "unverified"
    if fixed:
        return None
    return "risky" if major >= 12 else "unverified"


@dataclass(frozen=True)
class Hardware:
    """Facts about the machine (or the target machine) and the installed libraries that rules depend on.

    Args:
        accelerator (`str`):
            `"cuda"`, `"xpu"`, `"mps"` or `"cpu"`.
        bf16_supported (`bool`):
            Whether bf16 has hardware support (Ampere or newer GPU, or the CPU, whose autocast supports bf16). Emulated
            bf16 (pre-Ampere GPUs) does not count.
        flash_attn_version (`str | None`):
            The installed `flash_attn` version, if any.
        device_name (`str | None`):
            The GPU name as `torch.cuda.get_device_name()` reports it, e.g. `"NVIDIA H20"`.
        cuda_version (`str | None`):
            The CUDA version torch was built for (`torch.version.cuda`), e.g. `"12.1"`.
        cublas_version (`str | None`):
            The version of the `nvidia-cublas-cu12` wheel torch loads, when it is installed from PyPI.
        cublas_probe (`str | None`):
            Result of running the known crashing cuBLAS GEMM in a subprocess: `"crashed"` (killed by SIGFPE),
            `"passed"`, `"failed"` (another error), or `None` when it was not run.
        source (`str`):
            Where these facts come from, for the report: `"this machine"`, or what `safe-trainers check` assumed.
    """

    accelerator: str = "cpu"
    bf16_supported: bool = True
    flash_attn_version: str | None = None
    device_name: str | None = None
    cuda_version: str | None = None
    cublas_version: str | None = None
    cublas_probe: str | None = None
    source: str = "this machine"

    @classmethod
    def detect(cls, probe: bool = True) -> "Hardware":
        """This machine. With `probe=True`, the known crashing cuBLAS GEMM is run in a subprocess, but only on a GPU
        and cuBLAS at risk ([`cublas_at_risk`]; elsewhere nothing is run)."""
        import torch

        flash = package_version("flash_attn")
        if torch.cuda.is_available():
            facts = cls(
                accelerator="cuda",
                bf16_supported=bool(torch.cuda.is_bf16_supported(including_emulation=False)),
                flash_attn_version=flash,
                device_name=torch.cuda.get_device_name(),
                cuda_version=torch.version.cuda,
                cublas_version=package_version("nvidia-cublas-cu12"),
            )
            if probe and cublas_at_risk(facts.device_name, facts.cuda_version, facts.cublas_version) == "risky":
                return _replace(facts, cublas_probe=run_cublas_probe())
            return facts
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            return cls(accelerator="xpu", bf16_supported=True, flash_attn_version=flash)
        if torch.backends.mps.is_available():
            return cls(accelerator="mps", bf16_supported=True, flash_attn_version=flash)
        return cls(accelerator="cpu", bf16_supported=True, flash_attn_version=flash)

    @classmethod
    def target(
        cls,
        name: str,
        *,
        bf16_supported: bool | None = None,
        cuda_version: str | None = None,
        cublas_version: str | None = None,
        flash_attn_version: str | None = None,
    ) -> "Hardware":
        """The facts for a target named by the user (`"H100"`, `"NVIDIA H20"`, `"V100"`, `"cpu"`, ...).

        bf16 support comes from the GPU's compute capability (`KNOWN_GPUS`) unless `bf16_supported` is given; an
        unknown GPU name needs it. Raises `ValueError` for an unknown GPU without `bf16_supported`.
        """
        if name.strip().lower() == "cpu":
            return cls(accelerator="cpu", bf16_supported=True, source="the CPU (bf16: yes)")
        capability = gpu_capability(name)
        if bf16_supported is None:
            if capability is None:
                known = ", ".join(KNOWN_GPUS)
                raise ValueError(
                    f"unknown GPU {name!r}: say whether it supports bf16 with `--bf16-supported true|false`, or use "
                    f"one of: {known}, cpu."
                )
            bf16_supported = capability >= BF16_MIN_CAPABILITY
        device_name = name if name.upper().startswith(("NVIDIA", "TESLA")) else f"NVIDIA {name}"
        facts = cls(
            accelerator="cuda",
            bf16_supported=bf16_supported,
            flash_attn_version=flash_attn_version,
            device_name=device_name,
            cuda_version=cuda_version,
            cublas_version=cublas_version,
        )
        return _replace(facts, source=facts.describe())

    def describe(self) -> str:
        """One line: the device, bf16 support and the CUDA/cuBLAS versions known."""
        if self.accelerator != "cuda":
            return f"{self.accelerator.upper()} (bf16: {'yes' if self.bf16_supported else 'no'})"
        parts = [f"bf16: {'yes' if self.bf16_supported else 'no'}"]
        parts.append(f"CUDA {self.cuda_version}" if self.cuda_version else "CUDA version not given")
        if self.cublas_version:
            parts.append(f"cuBLAS {self.cublas_version}")
        if self.cublas_probe:
            parts.append(f"cuBLAS probe: {self.cublas_probe}")
        return f"{self.device_name or 'a CUDA GPU'} ({', '.join(parts)})"


def gpu_capability(name: str) -> tuple[int, int] | None:
    """The compute capability of a GPU named like `torch.cuda.get_device_name()` (longest known fragment wins)."""
    upper = name.upper()
    matches = [key for key in KNOWN_GPUS if re.search(rf"(?<![A-Z0-9]){re.escape(key.upper())}(?![A-Z0-9])", upper)]
    return KNOWN_GPUS[max(matches, key=len)] if matches else None


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_cublas_probe(code: str = CUBLAS_PROBE_CODE, timeout: float = 300.0) -> str:
    """Run `code` in a fresh Python process: `"crashed"` if SIGFPE killed it, `"passed"` if it exited 0, `"failed"`
    otherwise (another error or a timeout). Never run in-process: a SIGFPE cannot be caught."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return "failed"
    if done.returncode == -signal.SIGFPE:
        return "crashed"
    return "passed" if done.returncode == 0 else "failed"


def _replace(facts: Hardware, **changes) -> Hardware:
    import dataclasses

    return dataclasses.replace(facts, **changes)


__all__ = ["KNOWN_GPUS", "Hardware", "cublas_at_risk", "gpu_capability", "run_cublas_probe", "version_tuple"]
