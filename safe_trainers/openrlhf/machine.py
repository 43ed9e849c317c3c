"""What the shim asks of this machine and does on it: the installed OpenRLHF release, whether the GPUs have bf16 (asked
of `nvidia-smi`, so that the shim never imports torch), and running the launcher in its own process group with the
signals the shim receives passed on. The decisions are in `shim.py`; these are the side effects.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any


def installed_openrlhf_version() -> str | None:
    """The version of the installed `openrlhf` distribution, or `None` when it is not installed."""
    try:
        return importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return None


# Signals a job scheduler, `timeout`, Kubernetes or a terminal sends to the shim (the top process), passed on to the
# launcher's process group so the launcher and its workers stop too. SIGKILL cannot be caught or passed on.
FORWARDED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)  # fmt: skip


def launch(argv: list[str]) -> subprocess.CompletedProcess:
    """Run `argv` (no shell) in its own process group and wait for it, forwarding every signal of
    `FORWARDED_SIGNALS` that reaches this process to that whole group (launcher and workers, exactly once: a
    terminal's Ctrl-C reaches only this process's group). Returns when the launcher exits, with its exit status.

    Raises:
        `FileNotFoundError`: the launcher is not on `PATH`.
    """
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    process = subprocess.Popen(argv, **group)

    def forward(signum: int, frame: object) -> None:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:  # the group is already gone
            pass

    handlers = {}
    if threading.current_thread() is threading.main_thread():  # Python installs handlers only there
        handlers = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        returncode = process.wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(argv, returncode)


def local_bf16_support(query: Callable[..., Any] = subprocess.run) -> bool | None:
    """Whether this machine's GPUs support bf16 (compute capability 8.0 or more), asked of `nvidia-smi` so that the
    shim never imports torch; `None` when there is no NVIDIA GPU here to ask (e.g. a Ray head) or no answer."""
    try:
        argv = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
        done = query(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    capabilities = [line.strip() for line in (done.stdout or "").splitlines() if line.strip()]
    if done.returncode != 0 or not capabilities:
        return None
    try:
        return all(tuple(int(x) for x in cap.split(".")) >= (8, 0) for cap in capabilities)
    except ValueError:
        return None


__all__ = ["FORWARDED_SIGNALS", "installed_openrlhf_version", "launch", "local_bf16_support"]
