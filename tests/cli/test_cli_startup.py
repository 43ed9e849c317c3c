"""The command line starts fast (issue 12, item 9): `safe-trainers --help`, `rules` and the OpenRLHF shim import
neither torch nor transformers (the shim wraps every OpenRLHF launch; transformers alone takes seconds to import).
Timings are the bench's job (`python bench/cli_startup.py`); this test guards what makes them fast."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


HEAVY = ("torch", "transformers", "trl", "datasets", "accelerate", "peft", "numpy")
SHIM_COMMAND = [
    "openrlhf", "--dry-run", "--", "deepspeed", "--module", "openrlhf.cli.train_rm",
    "--pretrain", "google/gemma-2-2b-it", "--bf16", "--flash_attn", "--max_norm", "0",
]  # fmt: skip


def heavy_modules_after(argv: list[str]) -> list[str]:
    """Run `safe-trainers <argv>` in a fresh interpreter; return the heavy packages it imported."""
    code = (
        "import contextlib, io, json, sys\n"
        "from safe_trainers.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n"
        f"        main({argv!r})\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["rules"], SHIM_COMMAND], ids=["help", "rules", "openrlhf"])
def test_the_light_commands_import_no_ml_library(argv):
    assert heavy_modules_after(argv) == []


@pytest.mark.slow  # a process of its own, or a real run
def test_import_safe_trainers_resolves_names_on_first_use():
    code = (
        "import sys, safe_trainers as st\n"
        "light = 'transformers' not in sys.modules\n"
        "cls = st.DPOTrainer\n"
        "print(light, 'transformers' in sys.modules, cls.__module__, 'TrlParser' in st.__all__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.split() == ["True", "True", "safe_trainers.trainers", "True"]


def test_bf16_support_is_asked_of_nvidia_smi_not_torch():
    from safe_trainers.openrlhf.machine import local_bf16_support

    def answer(stdout: str, returncode: int = 0):
        return lambda *args, **kwargs: subprocess.CompletedProcess(args, returncode, stdout=stdout)

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    assert local_bf16_support(answer("9.0\n9.0\n")) is True  # H100s
    assert local_bf16_support(answer("8.0\n7.0\n")) is False  # one V100 among them
    assert local_bf16_support(answer("", 9)) is None and local_bf16_support(missing) is None
