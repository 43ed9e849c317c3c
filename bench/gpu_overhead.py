"""Benchmark: the NaN guard's overhead on a GPU, on a model of at least 0.5B parameters in bf16.

The measurement of `guard_overhead.py` (the same DPO workload trained with stock `trl.DPOTrainer` and with
`safe_trainers.DPOTrainer`, whole `train()` calls interleaved in one process; headline: the ratio of the summed
whole-run times, every snapshot, check, log and save included; beside it the per-step median ratio, from CUDA events,
no synchronisation per step), on a Qwen2-style model built from a config with random weights (hidden 1536, 16
layers: 0.57B parameters), bf16 mixed precision and the default fused AdamW. Prints both ratios, the check + snapshot
and rollback times, the host memory the snapshot holds (all of it pinned) and the device memory the guard adds.

By default a snapshot every 10 steps, fixed (`--snapshot-steps 10 --snapshot-budget 0`: issue 30's figure, the
copies' overlap at a known cadence), 40 steps a run; `--snapshot-steps 0 --snapshot-budget 0.01` measures the guard's
defaults instead (the interval adapts, bounded by the checkpoint at the last step).

On one H100 (before issue 30's overlap and adaptive interval) a stock step took 180.9 ms and one check + snapshot
156.4 ms every 10 steps: about +8.6% of the run's wall time, which the per-step median (0.973, 0.991) left out.

    python bench/gpu_overhead.py                     # needs a CUDA GPU
    python bench/gpu_overhead.py --snapshot-steps 0 --snapshot-budget 0.01
    python bench/gpu_overhead.py --hidden 2048 --layers 24 --optims adamw_torch_fused,adamw_torch
"""

from __future__ import annotations

import sys

import torch
from guard_overhead import main as measure_and_report
from guard_overhead import parse
from workload import parameter_count


MIN_PARAMETERS = 500_000_000
DEFAULTS = dict(
    workloads="dpo", hidden=1536, layers=16, seq=512, batch=8, steps=40, rounds=4, optims="adamw_torch_fused",
    snapshot_steps=10, snapshot_budget=0.0,
)


def main(argv=None) -> int:
    if not torch.cuda.is_available():
        print("gpu_overhead.py needs a CUDA GPU; on a CPU run bench/guard_overhead.py.", file=sys.stderr)
        return 2
    ns = parse(argv, **DEFAULTS)
    params = parameter_count(ns.hidden, ns.layers)
    if params < MIN_PARAMETERS:
        print(
            f"--hidden {ns.hidden} --layers {ns.layers} gives {params / 1e9:.2f}B parameters; this bench is for "
            f"{MIN_PARAMETERS / 1e9:.1f}B or more (e.g. the default --hidden 1536 --layers 16).",
            file=sys.stderr,
        )
        return 2
    return measure_and_report(argv, **DEFAULTS)


if __name__ == "__main__":
    sys.exit(main())
