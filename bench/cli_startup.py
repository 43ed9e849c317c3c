"""Start-up time of the `safe-trainers` commands, against importing TRL, in fresh processes.

    python bench/cli_startup.py [--runs 5]

Prints one table: the median, min and max wall time of each command over `--runs` runs (after one warm-up run, so the
file cache is warm), and the median as a ratio to `python -c "from trl import DPOConfig"` measured in the same run.
Run it on an idle machine; the numbers are whole-process times, interpreter start-up included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "safe_trainers.cli.main"]
SHIM = [
    "openrlhf", "--dry-run", "--", "deepspeed", "--module", "openrlhf.cli.train_rm",
    "--pretrain", "google/gemma-2-2b-it", "--bf16", "--flash_attn", "--max_norm", "0",
]  # fmt: skip
REFERENCE = "python -c 'from trl import DPOConfig'"
COMMANDS: dict[str, list[str]] = {
    "safe-trainers --help": [*CLI, "--help"],
    "safe-trainers rules": [*CLI, "rules"],
    "safe-trainers openrlhf --dry-run -- <train_rm>": [*CLI, *SHIM],
    "safe-trainers check --trainer dpo --config configs/trainers/dpo.yaml": [
        *CLI, "check", "--trainer", "dpo", "--config", "configs/trainers/dpo.yaml",
    ],  # fmt: skip
    "python -c 'import trl'": [sys.executable, "-c", "import trl"],
    REFERENCE: [sys.executable, "-c", "from trl import DPOConfig"],
    "python -c 'import transformers; transformers.TrainingArguments'": [
        sys.executable, "-c", "import transformers; transformers.TrainingArguments",
    ],  # fmt: skip
}


def wall_times(argv: list[str], runs: int) -> list[float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    times = []
    for i in range(runs + 1):
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if i:  # the first run warms the file cache
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    results = {name: wall_times(argv, runs) for name, argv in COMMANDS.items()}
    reference = statistics.median(results[REFERENCE])
    print(f"CLI start-up, {runs} runs each (seconds; ratio = median / median of `{REFERENCE}`)\n")
    width = max(map(len, results))
    print(f"| {'command':<{width}} | median |   min |   max | ratio |")
    print(f"|{'-' * (width + 2)}|-------:|------:|------:|------:|")
    for name, times in results.items():
        median = statistics.median(times)
        cells = f"{median:6.2f} | {min(times):5.2f} | {max(times):5.2f} | {median / reference:5.2f}"
        print(f"| {name:<{width}} | {cells} |")


if __name__ == "__main__":
    main()
