"""The shim's answer when the launcher it was given cannot be started: one line and the shell's exit code, no
traceback, nothing run."""

from __future__ import annotations

import io

from safe_trainers.openrlhf import shim


def test_a_launcher_script_without_its_executable_bit(tmp_path):
    # was: subprocess's PermissionError traceback (exit 1) after the report
    script = tmp_path / "run_dpo.sh"
    script.write_text("#!/bin/sh\nexec deepspeed \"$@\"\n")
    script.chmod(0o644)
    err = io.StringIO()
    command = [str(script), "--module", "openrlhf.cli.train_dpo", "--pretrain", "x"]
    assert shim.run(command, stderr=err, stdout=io.StringIO(), bf16_supported=True) == 126
    assert f"`{script}` cannot be executed (permission denied)" in err.getvalue()
    assert f"chmod +x {script}" in err.getvalue() and "Traceback" not in err.getvalue()
