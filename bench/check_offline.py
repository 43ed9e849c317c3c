"""`safe-trainers check` on every shipped config on a machine without the Hub (issue 23, item 2).

Each config is checked in a fresh process, as a user runs it, with no `HF_HUB_OFFLINE` set: the check decides itself
that the Hub cannot be reached. Prints one row per config: the wall time, the exit status, whether exactly one line
said it is offline, and the count of Hub retry lines (0 expected). Target: under 15 s each.

On a machine that can reach the Hub, pass `--endpoint http://127.0.0.1:9` to stand in for one that cannot (nothing
listens there); by default the real endpoint is used.

    python bench/check_offline.py [--endpoint URL]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 15.0
CONFIGS = sorted((ROOT / "configs" / "trainers").glob("*.yaml"))


def trainer_of(config: Path) -> str:
    """The trainer a shipped config is for: its file name up to the first `_` (`reward_lora.yaml` -> reward)."""
    return config.stem.split("_")[0]


def check(config: Path, endpoint: str | None) -> tuple[float, int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    command = [sys.executable, "-m", "safe_trainers.cli.main", "check", "--trainer", trainer_of(config),
               "--config", str(config.relative_to(ROOT))]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return time.perf_counter() - start, done.returncode, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", default=None, help="HF_ENDPOINT for the checks (default: the real one).")
    args = parser.parse_args()
    print(f"{'config':<22} {'trainer':<7} {'seconds':>8} {'exit':>4} {'offline lines':>13} {'retries':>7}  target")
    worst = 0.0
    for config in CONFIGS:
        seconds, code, output = check(config, args.endpoint)
        offline = sum("so working offline" in line for line in output.splitlines())
        retries = sum("Retrying in" in line for line in output.splitlines())
        worst = max(worst, seconds)
        verdict = "ok" if seconds < TARGET_S and offline == 1 and retries == 0 else "MISSED"
        row = f"{config.name:<22} {trainer_of(config):<7} {seconds:>8.1f} {code:>4} {offline:>13} {retries:>7}"
        print(f"{row}  {verdict}")
    print(f"slowest: {worst:.1f} s (target < {TARGET_S:g} s each); load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
