"""How much one training step's cost varies on this machine, stock TRL against safe_trainers: per step, the process's
user and system CPU time and its minor page faults (`resource.getrusage`), for `--pairs` pairs of short DPO runs in one
process (stock, safe, stock, safe, ...), snapshots at the guard's defaults, no checkpoint.

It explains the spread of `guard_scaling.py`'s whole-run ratio: when the same step's CPU time varies by more than the
guard's cost within one run, two rounds cannot resolve that cost, and the guard's own account (the snapshot work it
reports) is the figure to read. The first step of each run (allocations, page faults of fresh buffers) is left out of
the summary.

    python bench/step_noise.py --hidden 1024 --layers 12 --steps 6 --pairs 2
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from workload import build_model_dir, dataset, make_trainer, markdown_table, quiet, release  # noqa: E402


class StepUsage(TrainerCallback):
    """Per optimizer step: (user s, system s, minor page faults, wall s)."""

    leaves_state_alone = True  # it only reads counters: the guard treats it as read-only (trainer/read_only.py)

    def __init__(self):
        self.rows: list[tuple[float, float, int, float]] = []
        self._start: tuple[float, float, int, float] | None = None

    @staticmethod
    def _now() -> tuple[float, float, int, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime, usage.ru_stime, usage.ru_minflt, time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        end = self._now()
        self.rows.append(tuple(e - s for e, s in zip(end, self._start)))


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    ns = parse(argv)
    quiet()
    torch.set_num_threads(ns.threads)
    root = tempfile.mkdtemp(prefix="step-noise-")
    runs: dict[str, list[tuple[float, float, int, float]]] = {"stock": [], "safe": []}
    try:
        model = build_model_dir(os.path.join(root, "model"), ns.hidden, ns.layers)
        data = dataset(ns.steps * ns.batch, ns.seq)
        for index in range(2 * ns.pairs):
            kind = ("stock", "safe")[index % 2]
            out = os.path.join(root, f"{kind}{index}")
            trainer = make_trainer(kind, model, out, data, ns.steps, ns.batch, 0, "adamw_torch_fused", save_steps=0)
            usage = StepUsage()
            trainer.add_callback(usage)
            trainer.train()
            runs[kind].extend(usage.rows[1:])
            del trainer, usage
            release()
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for kind, steps in runs.items():
        user = [row[0] for row in steps]
        rows.append((
            kind, len(steps), f"{min(user):.2f}-{max(user):.2f}", f"{statistics.median(user):.2f}",
            f"{statistics.pstdev(user) / statistics.mean(user) * 100:.1f}%",
            f"{statistics.median(row[1] for row in steps):.2f}", f"{statistics.median(row[2] for row in steps):,.0f}",
        ))  # fmt: skip
    header = ["run", "steps", "user CPU s, range", "median", "spread (sd / mean)", "system s, median",
              "minor faults a step, median"]  # fmt: skip
    print(f"\nDPO {ns.hidden}x{ns.layers}, batch {ns.batch}, ~{ns.seq} tokens, {ns.threads} torch thread(s), "
          f"{ns.pairs} pairs of {ns.steps}-step runs (first step of each left out)\n")
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
