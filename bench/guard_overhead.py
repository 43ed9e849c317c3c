"""Benchmark: the NaN guard's cost over whole runs when nothing goes wrong, its snapshot cost, the time to roll back,
and the memory it holds.

Trains the same DPO workload with stock TRL (`trl.DPOTrainer`) and with `safe_trainers.DPOTrainer` (rules + guard
on), interleaved in one process (stock, safe, safe, stock, ...) so that both see the same machine state. Each run is
a whole `train()` call that logs every `--logging-steps` and saves a checkpoint every `--save-steps` (by default once,
at its last step), as a real run does. The headline is the ratio of the summed whole-run times, safe / stock (every
snapshot, check, log and save included); the per-step median ratio is printed beside it, labelled: it drops the steps
that carry a snapshot. The per-step times come from the same runs, with no synchronisation per step (CUDA events on a
GPU). Once with the fused AdamW transformers uses by default (the guard skips on the device) and once with the
non-fused `adamw_torch` (the guard reads its flag on the host each step). Absolute times are for reference only.

Two workloads by default (`--workloads`, sizes in `workload.WORKLOADS`): `dpo`, compute-bound (a 1.1M-parameter
model, a ~100 ms step here), and `memory-bound`, a model whose state is large next to its compute (a 64k-token
untied vocabulary, batch 1, ~16 tokens: ~430 MB of state with AdamW), where the snapshot's copies weigh as on a GPU.

    python bench/guard_overhead.py                      # CPU: both workloads, a few minutes on 2 cores
    python bench/guard_overhead.py --workloads memory-bound --optims adamw_torch_fused
    python bench/guard_overhead.py --hidden 1024 --layers 8 --seq 512 --batch 8   # e.g. on a GPU

`gpu_overhead.py` runs it on a 0.5B model on a GPU; the workload itself is in `workload.py`, the interleaved
whole-run comparison in `whole_run.py`.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from whole_run import (
    Comparison,
    SnapshotAccount,
    headline_rows,
    interleave,
    run_shape,
    snapshot_account,
    step_clock_note,
)
from workload import (
    chosen_intervals,
    last_interval,
    WORKLOADS,
    GuardMemoryProbe,
    StepTimer,
    apply_workload,
    build_model_dir,
    dataset,
    device_name,
    make_trainer,
    markdown_table,
    pinned_bytes,
    quiet,
    release,
    snapshot_bytes,
    time_snapshot,
    timed_train,
)


def parse(argv=None, **defaults) -> argparse.Namespace:
    """The bench's command line; `defaults` override the CPU defaults (the GPU bench passes a 0.5B model). A size
    left unset comes from each workload (`workload.WORKLOADS`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="dpo,memory-bound", help=f"comma-separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None, help="the model's vocabulary (default: the workload's)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved (stock, safe) pairs")
    parser.add_argument(
        "--snapshot-steps", type=int, default=None,
        help="`nan_snapshot_steps` of the guarded runs (default: unset, the guard's default: the interval adapts)",
    )  # fmt: skip
    parser.add_argument("--logging-steps", type=int, default=5, help="`logging_steps` of every run")
    parser.add_argument("--save-steps", type=int, default=None, help="`save_steps` (default: --steps; 0: no save)")
    parser.add_argument("--optims", default="adamw_torch_fused,adamw_torch", help="comma-separated `optim` values")
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="`wall`: wall time (the headline's measure); `cpu`: this process's CPU time, for a CPU machine that other "
        "jobs load (their load inflates wall time far more than this process's own work; with `--threads 1`)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--spike-factor", type=float, default=None, help="`nan_spike_factor` of the guarded runs")
    parser.add_argument(
        "--snapshot-budget", type=float, default=None,
        help="`nan_snapshot_budget` of the guarded runs (default: the guard's, 0.01; 0: every --snapshot-steps)",
    )  # fmt: skip
    parser.set_defaults(**defaults)
    ns = parser.parse_args(argv)
    ns.save_steps = ns.steps if ns.save_steps is None else ns.save_steps
    return ns


def main(argv=None, **defaults) -> int:
    parsed = parse(argv, **defaults)
    quiet()
    if parsed.threads:
        torch.set_num_threads(parsed.threads)
    root = tempfile.mkdtemp(prefix="guard-bench-")
    try:
        for name in parsed.workloads.split(","):
            ns = copy.copy(parsed)
            ns.workload = name
            apply_workload(ns)
            model_dir = build_model_dir(os.path.join(root, name), ns.hidden, ns.layers, vocab=ns.vocab)
            data = dataset(ns.steps * ns.batch, ns.seq)
            for optim in ns.optims.split(","):
                report(measure(ns, optim, root, model_dir, data))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


@dataclass
class Measurement:
    """What one [`measure`] call found (times in seconds, memory in bytes)."""

    ns: argparse.Namespace
    optim: str
    params: int
    runs: Comparison  # whole-run times and median step times, per kind and round
    snapshot: float  # state check + snapshot
    restore: float
    snapshot_bytes: int
    pinned_bytes: int
    batch_bytes: int
    device_flag_bytes: int
    device_extra: float | None  # peak device memory, safe - stock (GPU only)
    spike_factor: float = 0.0  # the guarded runs' `nan_spike_factor`
    intervals: list[list[int]] = field(default_factory=list)  # each safe run's snapshot intervals, as chosen
    accounts: list[SnapshotAccount] = field(default_factory=list)  # each safe run's own account of its snapshots


def measure(ns, optim: str, root: str, model_dir: str, data: Dataset) -> Measurement:
    peak_memory = {"stock": [], "safe": []}
    snapshot_times, restore_times = [], []
    seen: dict = {}
    settings = {} if ns.spike_factor is None else {"nan_spike_factor": ns.spike_factor}  # the guarded runs' own
    if ns.snapshot_budget is not None:
        settings["nan_snapshot_budget"] = ns.snapshot_budget

    def run(kind: str, round_index: int) -> tuple[float, list[float]]:
        out = os.path.join(root, f"{ns.workload}-{optim}-{kind}{round_index}")
        trainer = make_trainer(
            kind, model_dir, out, data, ns.steps, ns.batch, ns.snapshot_steps, optim,
            logging_steps=ns.logging_steps, save_steps=ns.save_steps, **settings,
        )  # fmt: skip
        timer = StepTimer(CLOCKS[ns.clock])
        trainer.add_callback(timer)
        if kind == "safe":
            probe = GuardMemoryProbe(trainer.nan_guard)
            trainer.add_callback(probe)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        whole = timed_train(trainer, CLOCKS[ns.clock])
        wall = time.perf_counter() - began
        if torch.cuda.is_available():
            peak_memory[kind].append(torch.cuda.max_memory_allocated())
        if kind == "safe":
            # The guard's own account of the run, read before `time_snapshot` adds its timed snapshots to it.
            seen.setdefault("accounts", []).append(snapshot_account(trainer, wall))
            taken, restored = time_snapshot(trainer)
            snapshot_times.extend(taken)
            restore_times.extend(restored)
            held = trainer.nan_guard.snapshotter.snapshot
            seen.setdefault("intervals", []).append(chosen_intervals(trainer.nan_guard))
            seen.update(
                held_bytes=snapshot_bytes(held), held_pinned=pinned_bytes(held),
                params=sum(p.numel() for p in trainer.model.parameters()),
                spike_factor=trainer.nan_guard.settings.nan_spike_factor,
                batch_bytes=probe.batch_bytes, flag_bytes=probe.device_bytes,
            )  # fmt: skip
            # The probe holds the guard, which holds the trainer: drop both before the next run is built, or the
            # last safe run's model, optimizer and snapshot stay alive through the next round.
            del probe, held
        step_times = timer.times[2:]  # the first steps warm up allocators and kernels
        del trainer
        release()
        shutil.rmtree(out, ignore_errors=True)
        return whole, step_times

    runs = interleave(ns.rounds, run)
    extra = None
    if torch.cuda.is_available():
        extra = statistics.median(peak_memory["safe"]) - statistics.median(peak_memory["stock"])
    return Measurement(
        ns=ns,
        optim=optim,
        params=seen["params"],
        runs=runs,
        snapshot=statistics.median(snapshot_times),
        restore=statistics.median(restore_times),
        snapshot_bytes=seen["held_bytes"],
        pinned_bytes=seen["held_pinned"],
        batch_bytes=seen["batch_bytes"],
        device_flag_bytes=seen["flag_bytes"],
        device_extra=extra,
        spike_factor=seen["spike_factor"],
        intervals=seen["intervals"],
        accounts=seen["accounts"],
    )


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK_NAMES = {"wall": "wall time", "cpu": "CPU time of the process"}
HEADER = ["measure", "stock TRL", "safe_trainers", "safe / stock"]


def rows(m: Measurement) -> list[tuple[str, str, str, str]]:
    """The table's rows: the whole-run headline and the per-step median (`whole_run.headline_rows`), then the
    snapshot's and rollback's times as fractions of a stock step."""
    every, stock = last_interval(m.intervals, m.ns.snapshot_steps), m.runs.median_step("stock")
    return headline_rows(m.runs) + [
        (f"check + snapshot (interval {every} steps)", "", f"{m.snapshot * 1e3:.1f} ms",
         f"{m.snapshot / stock:.3f} step"),
        ("snapshot, amortised per step", "", f"{m.snapshot / every * 1e3:.2f} ms", f"{m.snapshot / every / stock:.4f}"),
        ("rollback (restore the snapshot)", "", f"{m.restore * 1e3:.1f} ms", f"{m.restore / stock:.3f} step"),
    ]


def report(m: Measurement) -> None:
    ns, runs = m.ns, m.runs
    print(f"\n{ns.workload}: DPO, Qwen2-style model with {m.params / 1e6:.1f}M parameters, batch {ns.batch}, "
          f"~{ns.seq} tokens, {device_name()}, optim={m.optim}, nan_spike_factor={m.spike_factor}")
    shape = run_shape(ns.steps, ns.logging_steps, ns.save_steps, ns.snapshot_steps)
    print(f"snapshot intervals the guard chose, per safe run: {m.intervals}")
    print(f"snapshots taken (steps), per safe run: {[a.steps for a in m.accounts]}; the guard's own account of its "
          f"snapshot work (checks, copies, buffer allocations), per safe run: "
          f"{', '.join(f'{a.seconds:.2f}' for a in m.accounts)} s of wall time, "
          f"{', '.join(f'{a.share:.2%}' for a in m.accounts)} of the run's wall time")
    print(
        f"{ns.rounds} interleaved rounds of one whole `train()` call each ({shape}); headline: the summed whole-run "
        f"times, safe / stock (per round: {', '.join(f'{r:.3f}' for r in runs.round_ratios)}); "
        f"whole runs timed in {CLOCK_NAMES[ns.clock]}; {step_clock_note(torch.cuda.is_available())}, medians over "
        f"steps 3-{ns.steps} of each run, the ratio the median of the per-round ratios\n"
    )
    print(markdown_table(HEADER, rows(m)))
    print(f"\noverhead with the guard on: {(runs.whole_ratio - 1) * 100:+.2f}% of the whole run's wall time "
          f"(goal: < 1%), {(runs.step_ratio - 1) * 100:+.2f}% of the median step; "
          f"rollback = {m.restore / runs.median_step('stock'):.2f} steps (goal: < 2)")
    mib = 1024**2
    print("\nmemory held by the guard")
    print(f"  host, snapshot (weights + optimizer state): {m.snapshot_bytes / mib:.2f} MiB, of which pinned: "
          f"{m.pinned_bytes / mib:.2f} MiB")
    print(f"  host, micro-batch copies for diagnosis (peak): {m.batch_bytes / mib:.3f} MiB")
    if m.device_extra is not None:
        print(f"  device, flags and loss sums (peak): {m.device_flag_bytes} bytes; "
              f"peak device memory, safe - stock: {m.device_extra / mib:+.2f} MiB")
    else:
        print(f"  device: none beyond {m.device_flag_bytes} bytes of flags (CPU: host and device are the same memory)")


if __name__ == "__main__":
    sys.exit(main())
