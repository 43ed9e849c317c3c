"""The guard's benches still run against the guard they measure (a tiny model, a few steps; no timing is checked),
and the cost benches print the whole-run ratio as their headline, the per-step median beside it (issue 30)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
TINY = ["--steps", "3", "--seq", "16", "--batch", "2"]


SCALING = ["--sizes", "32x1", "--warmup", "1", "--rounds", "1", "--repeats", "1"]
OVERHEAD = ["--hidden", "32", "--layers", "1", "--vocab", "1000", "--rounds", "1", "--optims", "adamw_torch"]
MEMORY = ["--steps", "1", "--seq", "16", "--sizes", "32x1", "--methods", "lora"]
FINITE = ["--megabytes", "8", "--repeats", "1"]
SPIKES = ["--steps", "4", "--inject-steps", "4", "--kinds", "dpo", "--spike", "6", "4", "2"]
NOISE = ["--hidden", "32", "--layers", "1", "--seq", "16", "--steps", "3", "--pairs", "1"]
PREEMPTION = ["--hidden", "32", "--layers", "1", "--seq", "16", "--batch", "2", "--only", "overhead", "--rounds", "1",
              "--overhead-steps", "3"]  # fmt: skip


@pytest.mark.slow  # a process of its own, or a real run
@pytest.mark.parametrize(
    "script,args,expected",
    [
        (
            "guard_scaling.py",
            TINY + SCALING,
            ("snapshot held", "whole run, safe / stock", "per-step median ratio", "snapshot work per safe run"),
        ),
        ("guard_memory.py", MEMORY, "guard extra"),
        ("finite_check.py", FINITE, "catches a NaN"),
        ("spike_false_skips.py", SPIKES, "all skipped"),
        ("preemption_cost.py", PREEMPTION, "ratio to stock TRL"),
        ("step_noise.py", NOISE, "minor faults a step"),
    ],
)
def test_bench_runs_and_prints_its_table(script, args, expected):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, str(ROOT / "bench" / script), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    expected = (expected,) if isinstance(expected, str) else expected
    assert len(table) >= 2 and all(any(e in line for line in table) for e in expected), done.stdout[-3000:]


@pytest.mark.slow  # a process of its own
def test_guard_overhead_prints_each_workload_with_its_whole_run_headline():
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, str(ROOT / "bench" / "guard_overhead.py"), *TINY, *OVERHEAD]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    titles = [line.split(":")[0] for line in done.stdout.splitlines() if ": DPO, Qwen2-style model" in line]
    assert titles == ["dpo", "memory-bound"], done.stdout[-3000:]
    headlines = [line for line in done.stdout.splitlines() if line.startswith("| whole run")]
    assert len(headlines) == 2 and all(line.rstrip(" |").split()[-1][0].isdigit() for line in headlines)
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert all(any(e in line for line in table) for e in ("rollback", "per-step median ratio")), done.stdout[-3000:]
    account = "snapshots taken (steps), per safe run: [[0"
    accounts = [line for line in done.stdout.splitlines() if line.startswith(account)]
    assert len(accounts) == 2, done.stdout[-3000:]  # each workload's safe runs snapshot at step 0 first
    # The runs' own snapshots only: a step is copied at most twice in `train()` (the last one at its end and at its
    # save); the bench's own timed snapshots afterwards (`time_snapshot`, 3 of the last step) are not the run's.
    for line in accounts:
        runs = ast.literal_eval(line[len("snapshots taken (steps), per safe run: ") :].split("; ")[0])
        assert all(max(steps.count(step) for step in steps) <= 2 for steps in runs), line
