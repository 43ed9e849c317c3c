"""Benchmark: the NaN guard's cost when nothing goes wrong, its snapshot cost, the time to roll back, and the memory
it holds.

Trains the same DPO workload with stock TRL (`trl.DPOTrainer`) and with `safe_trainers.DPOTrainer` (rules + guard
on), interleaved in one process (stock, safe, stock, safe, ...) so that both see the same machine state, and prints a
table of ratios, once with the fused AdamW transformers uses by default (the guard skips on the device) and once with
the non-fused `adamw_torch` (the guard reads its flag on the host each step). Absolute times are for reference only.

    python bench/guard_overhead.py                      # CPU: a model whose DPO step takes ~100 ms here
    python bench/guard_overhead.py --hidden 1024 --layers 8 --seq 512 --batch 8   # e.g. on a GPU

`gpu_overhead.py` runs it on a 0.5B model on a GPU; the workload itself is in `workload.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass

import torch
from datasets import Dataset
from workload import (
    GuardMemoryProbe,
    StepTimer,
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
)


def parse(argv=None, **defaults) -> argparse.Namespace:
    """The bench's command line; `defaults` override the CPU defaults (the GPU bench passes a 0.5B model)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved (stock, safe) pairs")
    parser.add_argument("--snapshot-steps", type=int, default=10, help="`nan_snapshot_steps` of the guarded runs")
    parser.add_argument("--optims", default="adamw_torch_fused,adamw_torch", help="comma-separated `optim` values")
    parser.add_argument("--spike-factor", type=float, default=None, help="`nan_spike_factor` of the guarded runs")
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def main(argv=None, **defaults) -> int:
    ns = parse(argv, **defaults)
    quiet()
    root = tempfile.mkdtemp(prefix="guard-bench-")
    model_dir = build_model_dir(root, ns.hidden, ns.layers)
    data = dataset(ns.steps * ns.batch, ns.seq)
    for optim in ns.optims.split(","):
        report(measure(ns, optim, root, model_dir, data))
    return 0


@dataclass
class Measurement:
    """What one [`measure`] call found (times in seconds, memory in bytes)."""

    ns: argparse.Namespace
    optim: str
    params: int
    stock: float  # median step time
    safe: float
    ratio: float  # median of the per-round safe/stock ratios
    round_ratios: list[float]
    steps_measured: int
    snapshot: float  # state check + snapshot
    restore: float
    snapshot_bytes: int
    pinned_bytes: int
    batch_bytes: int
    device_flag_bytes: int
    device_extra: float | None  # peak device memory, safe - stock (GPU only)
    spike_factor: float = 0.0  # the guarded runs' `nan_spike_factor`


def measure(ns, optim: str, root: str, model_dir: str, data: Dataset) -> Measurement:
    step_times = {"stock": [], "safe": []}
    peak_memory = {"stock": [], "safe": []}
    snapshot_times, restore_times = [], []
    round_ratios = []
    for round_index in range(ns.rounds):
        # Alternate which runs first, and compare within a round: a paired design cancels slow drift of the machine.
        order = ("stock", "safe") if round_index % 2 == 0 else ("safe", "stock")
        medians = {}
        for kind in order:
            out = os.path.join(root, f"{optim}-{kind}{round_index}")
            spikes = {} if ns.spike_factor is None else {"nan_spike_factor": ns.spike_factor}
            trainer = make_trainer(kind, model_dir, out, data, ns.steps, ns.batch, ns.snapshot_steps, optim, **spikes)
            timer = StepTimer()
            trainer.add_callback(timer)
            if kind == "safe":
                probe = GuardMemoryProbe(trainer.nan_guard)
                trainer.add_callback(probe)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            trainer.train()
            if torch.cuda.is_available():
                peak_memory[kind].append(torch.cuda.max_memory_allocated())
            step_times[kind] += timer.times[2:]  # the first steps warm up allocators and kernels
            medians[kind] = statistics.median(timer.times[2:])
            if kind == "safe":
                taken, restored = time_snapshot(trainer)
                snapshot_times += taken
                restore_times += restored
                held = trainer.nan_guard.snapshotter.snapshot
                held_bytes, held_pinned = snapshot_bytes(held), pinned_bytes(held)
                params = sum(p.numel() for p in trainer.model.parameters())
                spike_factor = trainer.nan_guard.settings.nan_spike_factor
                batch_bytes, flag_bytes = probe.batch_bytes, probe.device_bytes
                # The probe holds the guard, which holds the trainer: drop both before the next run is built, or
                # the last safe run's model, optimizer and snapshot stay alive through the next round.
                del probe, held
            del trainer
            release()
        round_ratios.append(medians["safe"] / medians["stock"])
    extra = None
    if torch.cuda.is_available():
        extra = statistics.median(peak_memory["safe"]) - statistics.median(peak_memory["stock"])
    return Measurement(
        ns=ns,
        optim=optim,
        params=params,
        stock=statistics.median(step_times["stock"]),
        safe=statistics.median(step_times["safe"]),
        ratio=statistics.median(round_ratios),
        round_ratios=round_ratios,
        steps_measured=len(step_times["safe"]),
        snapshot=statistics.median(snapshot_times),
        restore=statistics.median(restore_times),
        snapshot_bytes=held_bytes,
        pinned_bytes=held_pinned,
        batch_bytes=batch_bytes,
        device_flag_bytes=flag_bytes,
        device_extra=extra,
        spike_factor=spike_factor,
    )


def rows(m: Measurement) -> list[tuple[str, str, str]]:
    """The table's rows: (measure, time, ratio to a stock step)."""
    every, stock = m.ns.snapshot_steps, m.stock
    return [
        ("step time, stock TRL (reference)", f"{stock * 1e3:.1f} ms", "1.000"),
        ("step time, safe_trainers (guard on)", f"{m.safe * 1e3:.1f} ms", f"{m.ratio:.3f}"),
        (f"check + snapshot (every {every} steps)", f"{m.snapshot * 1e3:.1f} ms", f"{m.snapshot / stock:.3f} step"),
        ("snapshot, amortised per step", f"{m.snapshot / every * 1e3:.2f} ms", f"{m.snapshot / every / stock:.4f}"),
        ("rollback (restore the snapshot)", f"{m.restore * 1e3:.1f} ms", f"{m.restore / stock:.3f} step"),
    ]


def report(m: Measurement) -> None:
    ns = m.ns
    print(f"\nDPO, Qwen2-style model with {m.params / 1e6:.1f}M parameters, batch {ns.batch}, ~{ns.seq} tokens, "
          f"{device_name()}, optim={m.optim}, nan_spike_factor={m.spike_factor}")
    print(
        f"{ns.rounds} interleaved rounds x {ns.steps} steps each; step times are medians over {m.steps_measured} "
        f"steps, the ratio is the median of the per-round ratios ({', '.join(f'{r:.3f}' for r in m.round_ratios)})\n"
    )
    print(markdown_table(["measure", "time", "ratio to a stock step"], rows(m)))
    print(f"\noverhead with the guard on: {(m.ratio - 1) * 100:+.2f}% of step time (goal: < 1%); "
          f"rollback = {m.restore / m.stock:.2f} steps (goal: < 2)")
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
