"""Linting a config, and the rules' fixed copy of `args`, set up no device (issue 28, section 4): transformers 5's
`TrainingArguments.__post_init__` reads `self.device` (and TRL 1.16's `pad_to_multiple_of="auto"` reads it again),
which resets accelerate's state and builds a `PartialState`: a process group under a launcher's environment, CUDA on a
GPU. `safe-trainers check` trains nothing, so it must set up none of it; the fixed copy must not set up or reset
anything the user's own config did not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from net_utils import free_port


ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, torch, torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
def probe(**extra):
    print("PROBE " + json.dumps({
        "process_group": dist.is_available() and dist.is_initialized(),
        "partial_state": bool(PartialState._shared_state),
        "accelerator_state": bool(AcceleratorState._shared_state),
        "cuda": torch.cuda.is_initialized(),
        **extra,
    }))
"""

CHECK = PROBE + """
import sys
from safe_trainers.cli.main import main
code = main(["check", "--trainer", sys.argv[1], "--config", sys.argv[2], *sys.argv[3:]])
probe(code=code)
"""

# The trainers' path: the user's config (which sets the state up, as transformers does), then the user's own
# `Accelerator`, then the rules' fixed copy of the config.
FIXED_COPY = PROBE + """
import sys
from accelerate import Accelerator
from safe_trainers.configs import config_class
from safe_trainers.rules.apply import replace_args
from safe_trainers.rules.report import Change
args = config_class(sys.argv[1])(output_dir=sys.argv[2], use_cpu=True, report_to="none")
accelerator = Accelerator(cpu=True)
copy, _ = replace_args(args, [Change("args.logging_nan_inf_filter", True, False)], None)
probe(mixed_precision=getattr(accelerator.state, "mixed_precision", None), copied=copy.logging_nan_inf_filter is False,
      same_device=str(copy.device) == str(args.device))
"""


def run_probe(script: str, args: list[str], launcher_env: bool) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if launcher_env:  # as in a shell of a job that a launcher started: a world of one process
        env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("PROBE "))


@pytest.mark.parametrize("launcher_env", [False, True], ids=["plain", "launcher-env"])
def test_check_sets_up_no_device(toy_models, tmp_path, launcher_env):
    # was: `partial_state` True (and `process_group` True under a launcher's environment)
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nreport_to: none\n")  # `logging_nan_inf_filter` gets fixed
    state = run_probe(CHECK, ["dpo", str(config), "--model", toy_models["qwen2"]], launcher_env)
    assert state == {"process_group": False, "partial_state": False, "accelerator_state": False, "cuda": False,
                     "code": 0}  # fmt: skip


def test_check_of_an_online_trainer_sets_up_no_device(toy_models, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nreport_to: none\nnum_generations: 2\n"
                      "per_device_train_batch_size: 2\n")  # fmt: skip
    state = run_probe(CHECK, ["grpo", str(config), "--model", toy_models["qwen2"], "--num-processes", "4"], True)
    assert not (state["process_group"] or state["partial_state"] or state["cuda"]), state


@pytest.mark.slow  # a process of its own, or a real run
@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_the_fixed_copy_of_args_sets_up_nothing_new(tmp_path, kind):
    # was: the copy's `__post_init__` reset accelerate's state, so the user's `Accelerator` lost its `mixed_precision`
    state = run_probe(FIXED_COPY, [kind, str(tmp_path / "out")], launcher_env=False)
    assert state["copied"] and state["same_device"] and state["mixed_precision"] == "no", state
    assert not (state["process_group"] or state["cuda"]), state


@pytest.mark.parametrize("missing", ["_setup_devices", "distributed_state", "_n_gpu"])
def test_without_one_of_transformers_device_names_the_copy_sets_up_its_own(tmp_path, missing):
    # A transformers that no longer records one of the names the copy shares (docs/design/upstream.md): the copy sets
    # its devices up as transformers does (the old behaviour) instead of sharing half of them.
    # was: with `distributed_state` missing, the copy kept the cached device and `copy.world_size` raised
    from safe_trainers.configs import config_class
    from safe_trainers.rules.apply import replace_args
    from safe_trainers.rules.report import Change

    args = config_class("dpo")(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    del vars(args)[missing]
    copy, _ = replace_args(args, [Change("args.logging_nan_inf_filter", True, False)], None)
    assert (str(copy.device), copy.world_size, copy.process_index, copy.n_gpu) == ("cpu", 1, 0, 0)
