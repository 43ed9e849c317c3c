"""Benchmark: the NaN guard's cost as the model grows, on the CPU.

For each model size (Qwen2-style, built from a config, randomly initialised, from about 1M to 190M parameters) it
trains the DPO workload of `workload.py` with stock TRL (`trl.DPOTrainer`) and with `safe_trainers.DPOTrainer` (rules
and guard on, default fused AdamW) in the same process, in `--rounds` pairs of whole `train()` calls whose order
alternates (each logs every `--logging-steps`, saves at its last step and, guarded, snapshots every
`--snapshot-steps`), then times the guard's state check + snapshot and a restore, and reads the host memory the
snapshot holds. The headline column is the ratio of the summed whole-run times, safe / stock; the per-step median
ratio is beside it (it drops the steps that carry a snapshot or a save).

Times are the process's CPU time on one torch thread by default: on a shared machine, other processes' load inflates
wall time far more than the work this process does (`--clock wall --threads 2` for wall time).

Prints a markdown table. What it should show: the guard's per-step cost stays flat, a few ms whatever the size, so the
per-step median ratio tends to 1; the snapshot's cost grows linearly with the state it copies (about constant ms per
MB), and with it the whole-run ratio wherever the step does not grow as fast as the state. The last column is
`safe_trainers.rules.snapshot_size`'s estimate of the snapshot (fp32 weights and two fp32 AdamW moments, 12 bytes per
parameter), next to what the snapshot really holds (which adds AdamW's step counters).

    python bench/guard_scaling.py                      # a few minutes on 2 cores
    python bench/guard_scaling.py --sizes 128x4,512x6 --steps 8
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from whole_run import interleave, run_shape, snapshot_account, step_clock_note
from workload import (
    StepTimer,
    build_model_dir,
    dataset,
    device_name,
    make_trainer,
    markdown_table,
    quiet,
    release,
    snapshot_bytes,
    time_snapshot,
    timed_train,
)

from safe_trainers.rules.snapshot_size import RunShape, per_rank_bytes


# `cpu`: the CPU time of this process, which other processes on a shared machine inflate far less than wall time.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
# hidden size x layers: about 1.1M, 4M, 24M, 71M and 190M parameters (vocabulary 384, MLP 4x hidden, GQA).
SIZES = "128x4,256x4,512x6,768x8,1024x12"


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=SIZES, help="comma-separated HIDDENxLAYERS model sizes")
    parser.add_argument("--seq", type=int, default=64, help="about this many tokens per sequence")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--snapshot-steps", type=int, default=3, help="`nan_snapshot_steps` of the guarded runs")
    parser.add_argument("--logging-steps", type=int, default=3, help="`logging_steps` of every run")
    parser.add_argument("--save-steps", type=int, default=None, help="`save_steps` (default: --steps; 0: no save)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the timing")
    parser.add_argument("--rounds", type=int, default=2, help="(stock, safe) pairs of runs per size")
    parser.add_argument("--repeats", type=int, default=3, help="snapshots and restores timed per size")
    parser.add_argument("--optim", default="adamw_torch_fused")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    ns = parser.parse_args(argv)
    ns.save_steps = ns.steps if ns.save_steps is None else ns.save_steps
    return ns


def measure_size(ns, hidden: int, layers: int, root: str) -> tuple:
    """One table row: `ns.rounds` (stock, safe) pairs of runs of one model size, the order alternating, then the
    snapshot's time and memory."""
    model_dir = build_model_dir(os.path.join(root, f"{hidden}x{layers}"), hidden, layers)
    data = dataset(ns.steps * ns.batch, ns.seq)
    clock, seen = CLOCKS[ns.clock], {}

    def run(kind: str, round_index: int) -> tuple[float, list[float]]:
        out = os.path.join(root, f"{hidden}x{layers}-{kind}{round_index}")
        trainer = make_trainer(
            kind, model_dir, out, data, ns.steps, ns.batch, ns.snapshot_steps, ns.optim,
            logging_steps=ns.logging_steps, save_steps=ns.save_steps,
        )  # fmt: skip
        timer = StepTimer(clock)
        trainer.add_callback(timer)
        began = time.perf_counter()
        whole = timed_train(trainer, clock)
        wall = time.perf_counter() - began
        if kind == "safe":  # the guard's own account of its snapshot work in this run
            seen.setdefault("accounts", []).append(snapshot_account(trainer, wall))
        if kind == "safe" and "taken" not in seen:
            seen["taken"], seen["restored"] = time_snapshot(trainer, ns.repeats, clock)
            seen["held"] = snapshot_bytes(trainer.nan_guard.snapshotter.snapshot)
            seen["params"] = sum(p.numel() for p in trainer.model.parameters())
        step_times = timer.times[ns.warmup :]
        del trainer
        release()
        shutil.rmtree(out, ignore_errors=True)
        return whole, step_times

    runs = interleave(ns.rounds, run)
    shutil.rmtree(os.path.dirname(model_dir), ignore_errors=True)
    snapshot, restore = statistics.median(seen["taken"]), statistics.median(seen["restored"])
    params, held, accounts = seen["params"], seen["held"], seen["accounts"]
    estimate = per_rank_bytes(RunShape(f"{hidden}x{layers}", params, params, "single"))
    return (
        f"{params / 1e6:.1f}M",
        f"{runs.mean_run('stock'):.2f}",
        f"{runs.mean_run('safe'):.2f}",
        f"{runs.whole_ratio:.3f}",
        ", ".join(f"{r:.3f}" for r in runs.round_ratios),
        f"{statistics.mean(a.seconds for a in accounts):.2f} ({statistics.mean(a.share for a in accounts):.2%})",
        "; ".join(" ".join(str(s) for s in a.steps) for a in accounts),
        f"{runs.median_step('stock') * 1e3:.0f}",
        f"{runs.median_step('safe') * 1e3:.0f}",
        f"{runs.step_ratio:.3f}",
        f"{snapshot * 1e3:.1f}",
        f"{snapshot * 1e3 / (held / 1e6):.3f}",
        f"{restore * 1e3:.1f}",
        f"{held:,}",
        f"{estimate:,}",
    )


HEADER = [
    "parameters",
    "stock run (s)",
    "safe run (s)",
    "whole run, safe / stock",
    "per round",
    "snapshot work per safe run, mean (wall s, share of the run's wall time)",
    "snapshot steps (each safe run)",
    "stock step (ms)",
    "safe step (ms)",
    "per-step median ratio",
    "check + snapshot (ms)",
    "snapshot ms per MB",
    "restore (ms)",
    "snapshot held (bytes)",
    "estimate (bytes)",
]


def main(argv=None) -> int:
    ns = parse(argv)
    quiet()
    torch.set_num_threads(ns.threads)
    root = tempfile.mkdtemp(prefix="guard-scaling-")
    start = time.perf_counter()
    rows = []
    try:
        for size in ns.sizes.split(","):
            hidden, layers = (int(v) for v in size.split("x"))
            rows.append(measure_size(ns, hidden, layers, root))
            print(f"measured {size} ({rows[-1][0]} parameters)", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    clock = "CPU time of the process" if ns.clock == "cpu" else "wall time"
    shape = run_shape(ns.steps, ns.logging_steps, ns.save_steps, ns.snapshot_steps)
    print(
        f"\nDPO, batch {ns.batch}, ~{ns.seq} tokens, {device_name()}, {ns.threads} torch thread(s), "
        f"optim={ns.optim}. Times are {clock}. Each size: {ns.rounds} interleaved pairs of whole `train()` calls "
        f"({shape}); runs are the mean whole-run times, the whole-run ratio that of their sums; "
        f"{step_clock_note(False)}, medians over {ns.steps - ns.warmup} steps of each run (after {ns.warmup} warm-up "
        f"steps), the per-step ratio the median of the per-round ratios; check + snapshot and restore are medians of "
        f"{ns.repeats}; snapshot work is the guard's own account of each safe run (`interval.spent_seconds`: "
        f"wall time, whatever the clock), its snapshot steps `interval.taken_at`; MB = 10^6 bytes. The bench took "
        f"{time.perf_counter() - start:.0f} s of wall time.\n"
    )
    print(markdown_table(HEADER, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
