"""FSDP2 wiring on one GPU, in one process: a one-process `accelerate launch` with accelerate's FSDP plugin at
`fsdp_version=2` and `FULL_STATE_DICT` saves, on CUDA (DTensor parameters, the plugin's gathered saves), a NaN loss
injected at step 3. The guard skips that step, the run ends at `max_steps`, and every checkpoint and the saved model
are finite.

One process is one rank: nothing here agrees a flag across ranks or restores per-rank shards. Cross-rank agreement
(a fault on one rank skipped or rolled back on every rank, the same weights on each) is covered on two CPU ranks by
`tests/guard/test_guard_fsdp2.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from safe_trainers.guard import read_events
from safe_trainers.testing.toy import save_toy_model

from gpu_utils import nonfinite_files, tensor_files
from guard_utils import checkpoint_steps
from net_utils import free_port


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "workers", "guard_worker.py")
# The shipped config (full state dicts, gathered on rank 0).
FSDP2 = ["--config_file", os.path.join(REPO, "configs", "accelerate", "fsdp2.yaml")]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_fsdp2_one_process_wiring_skips_the_fault_and_saves_finite(kind, tmp_path):
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out = tmp_path / "out"
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()), *FSDP2,
    ]  # fmt: skip
    cmd = launch + [WORKER, "--kind", kind, "--model", model, "--out", str(out), "--fault", "loss:3"]
    cmd += ["--gpu", "--save_final"]
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    with open(out / "result-rank0.json") as f:
        result = json.load(f)
    assert result["fsdp_version"] == 2 and "FULL_STATE_DICT" in result["state_dict_type"]
    # The diagnosis replays step 3's micro-batches, poisoned the same way: the fault may be listed more than once.
    assert {tuple(i) for i in result["injected"]} == {(3, "loss")} and result["global_step"] == 8
    assert (result["skipped"], result["rollbacks"]) == (1, 0)
    events = read_events(str(out / "run"))
    assert [(e["step"], e["kind"]) for e in events] == [(3, "skip")]
    assert checkpoint_steps(str(out / "run")) == [4, 8]
    files = tensor_files(str(out))
    final = [p for p in files if p.startswith(str(out / "final"))]
    assert any(p.endswith("model.safetensors") for p in final), files  # the gathered full model
    assert all(any(p.startswith(str(out / "run" / f"checkpoint-{s}")) for p in files) for s in (4, 8)), files
    assert not nonfinite_files(files)


@pytest.mark.distributed
def test_fsdp_version_1_is_refused_with_the_guard(tmp_path):
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()), *FSDP2, "--fsdp_version", "1",
    ]  # fmt: skip
    cmd = launch + [WORKER, "--kind", "dpo", "--model", model, "--out", str(tmp_path / "out"), "--gpu"]
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert done.returncode != 0
    assert "`nan_guard=True` protects FSDP version 2" in done.stderr, done.stderr[-4000:]
