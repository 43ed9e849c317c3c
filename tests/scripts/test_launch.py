"""The launch scripts under real launchers, 2 CPU processes each, on the embedded toy default (no model or dataset
given, no network): `accelerate launch` (DDP) for DPO and GRPO, and DPO with DeepSpeed ZeRO-3 under both the
`deepspeed` launcher (`configs/deepspeed/zero3.json`) and `accelerate launch`
(`configs/accelerate/deepspeed_zero3.yaml`).

Each run checks that training ran on both processes, that the model was saved and its weights changed against the toy
model the script built, and that `safety_report.json` was written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from net_utils import EXIT_RACE, free_port
from safetensors.torch import load_file


pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]  # = `accelerate launch`
DEEPSPEED = [sys.executable, "-m", "deepspeed.launcher.runner"]  # = `deepspeed`
QUICK = [
    "--max_steps", "2",
    "--per_device_train_batch_size", "2",
    "--learning_rate", "1e-3",
    "--logging_steps", "1",
    "--report_to", "none",
    "--disable_tqdm", "true",
    "--gradient_checkpointing", "false",
]  # fmt: skip


def launch(make_cmd, out: Path, extra_pythonpath: str | None = None, timeout: int = 600) -> tuple[Path, str]:
    """Run `make_cmd(port, out)` from the repo root; return the output dir and the output. Retries once, into a
    fresh output dir, on `EXIT_RACE` only."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), extra_pythonpath, env.get("PYTHONPATH")) if p)
    env.pop("ACCELERATE_USE_DEEPSPEED", None)
    for attempt in range(2):
        run_out = out if attempt == 0 else out.with_name(out.name + "-retry")
        done = subprocess.run(
            make_cmd(free_port(), run_out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        output = done.stdout + done.stderr
        if done.returncode == 0:
            return run_out, output
        if attempt == 1 or EXIT_RACE not in output:
            break
    pytest.fail(f"launch failed with exit code {done.returncode}:\n{output[-6000:]}")


def check_run(out: Path, kind: str, output: str, min_changed: int = 1) -> dict:
    """Steps logged, model saved with changed weights, safety report written; returns the trainer state."""
    [checkpoint] = list(out.glob("checkpoint-*"))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2]
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in state["log_history"] if "loss" in e)

    assert (out / "config.json").is_file()
    before = load_file(str(out / "toy-model" / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    assert set(after) == set(before)
    assert all(after[k].shape == before[k].shape for k in before)  # full weights, not ZeRO-3 shards
    # Compare at the saved precision, so a bf16 save of untrained fp32 weights does not count as a change.
    changed = [k for k in before if not torch.equal(after[k], before[k].to(after[k].dtype))]
    assert len(changed) >= min_changed, f"only {changed} changed"

    report = json.loads((out / "safety_report.json").read_text())
    assert report["trainer"] == kind and report["mode"] == "fix"
    assert "no `model_name_or_path` and no `dataset_name`" in output  # the embedded default was used
    assert output.count("safe_trainers: model saved to") == 1  # printed by the main process only
    return state


def test_accelerate_ddp_dpo_embedded_default(tmp_path):
    def cmd(port, out):
        return ACCELERATE + [
            "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--main_process_port", str(port), "launch/train_dpo.py", "--output_dir", str(out),
        ] + QUICK  # fmt: skip

    out, output = launch(cmd, tmp_path / "dpo")
    state = check_run(out, "dpo", output, min_changed=10)
    # 32 toy pairs, 2 per process: one step is 4 pairs with 2 processes (8 steps per epoch), 2 with 1.
    assert state["log_history"][-1]["epoch"] == pytest.approx(2 * 2 * 2 / 32)
    assert "no GPU found" in output or torch.cuda.is_available()


def test_accelerate_ddp_grpo_embedded_default_with_user_reward(tmp_path):
    rewards_dir = tmp_path / "rewards"
    rewards_dir.mkdir()
    (rewards_dir / "launch_rewards.py").write_text(
        textwrap.dedent(
            """
            def char_count(completions, **kwargs):
                return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
            """
        )
    )

    def cmd(port, out):
        return ACCELERATE + [
            "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--main_process_port", str(port), "launch/train_grpo.py", "--output_dir", str(out),
            "--reward_funcs", "launch_rewards:char_count", "--num_generations", "2", "--max_completion_length", "8",
        ] + QUICK  # fmt: skip

    out, output = launch(cmd, tmp_path / "grpo", extra_pythonpath=str(rewards_dir))
    state = check_run(out, "grpo", output)
    assert any("rewards/char_count/mean" in entry for entry in state["log_history"])


def test_deepspeed_zero3_dpo_embedded_default(tmp_path):
    def cmd(port, out):
        return DEEPSPEED + [
            "--num_gpus", "2", "--master_port", str(port),
            "launch/train_dpo.py", "--deepspeed", "configs/deepspeed/zero3.json", "--output_dir", str(out),
        ] + QUICK  # fmt: skip

    out, output = launch(cmd, tmp_path / "dpo-zero3")
    check_run(out, "dpo", output, min_changed=10)
    # ZeRO-3 over 2 ranks: each rank saved its own shard of the model states.
    shards = sorted(p.name for p in out.glob("checkpoint-2/global_step2/zero_pp_rank_*_model_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]


def test_accelerate_deepspeed_zero3_config_dpo_embedded_default(tmp_path):
    """The shipped accelerate ZeRO-3 config (bf16), with the process count overridden to 2."""

    def cmd(port, out):
        return ACCELERATE + [
            "--config_file", "configs/accelerate/deepspeed_zero3.yaml", "--num_processes", "2",
            "--main_process_port", str(port), "launch/train_dpo.py", "--output_dir", str(out),
        ] + QUICK  # fmt: skip

    out, output = launch(cmd, tmp_path / "dpo-accelerate-zero3")
    check_run(out, "dpo", output, min_changed=10)
    shards = sorted(p.name for p in out.glob("checkpoint-2/global_step2/zero_pp_rank_*_model_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
