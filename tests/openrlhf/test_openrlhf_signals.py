"""`safe-trainers openrlhf` passes the signals it receives on to the launcher and its workers.

`timeout`, Kubernetes and job schedulers signal only the top process, here the shim. The test runs the real command
line in a subprocess, with a "launcher" (a `train_rm.py` script, OpenRLHF's pre-0.3.6 form) that starts a "worker"
process, then signals the shim alone and checks that both are gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest


LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.1)"])
with open({pids!r}, "w") as f:
    f.write(f"{{__import__('os').getpid()}} {{worker.pid}}")
worker.wait()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting to be reaped is not running
        return f.read().split(")")[-1].split()[0] != "Z"


def default_sigint() -> None:
    """SIGINT's default action in the shim and so in what it starts: a shell starts a background job (`pytest &`) with
    SIGINT ignored, which its children inherit, and a launcher that ignores SIGINT outlives the signal it is sent."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 128 + signal.SIGINT)])
def test_signal_to_the_shim_reaches_the_launcher_and_its_workers(tmp_path, signum, code):
    pids_file = tmp_path / "pids"
    script = tmp_path / "train_rm.py"
    script.write_text(textwrap.dedent(LAUNCHER.format(pids=str(pids_file))))
    shim = subprocess.Popen(
        [sys.executable, "-m", "safe_trainers.cli.main", "openrlhf", "--",
         sys.executable, str(script), "--pretrain", "Qwen/Qwen2-0.5B", "--max_norm", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,  # no terminal signals from pytest
        preexec_fn=default_sigint,
    )  # fmt: skip
    launcher = worker = None
    try:
        assert wait_for(lambda: pids_file.exists() and len(pids_file.read_text().split()) == 2, 120), (
            shim.stderr.read().decode() if shim.poll() is not None else "the launcher did not start"
        )
        launcher, worker = (int(p) for p in pids_file.read_text().split())
        shim.send_signal(signum)  # the shim only, as `timeout` or a scheduler does
        assert shim.wait(timeout=60) == code  # the launcher's exit status, 128 + N when killed by signal N
        assert wait_for(lambda: not alive(launcher) and not alive(worker), 30), "launcher or worker still running"
    finally:
        for pid in (launcher, worker):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        if shim.poll() is None:
            shim.kill()
