"""The DDP mode of `guard_memory.py`: the snapshot's host memory per rank when DDP's ranks share one copy out.

A full fine-tune (DPO, bf16 weights, a snapshot after every step) under DDP on N CPU ranks (gloo, `accelerate launch`),
each run a fresh launch, guard off and guard on. Per rank: the peak resident memory (`ru_maxrss`), the bytes its
snapshot holds (`HostBuffers.nbytes()`) and S, the state one process's snapshot would copy (the trainable weights and
the optimizer state). The guard's extra per rank is guard on - guard off, against the target S/N + 5%. Its passes over
the state (the finiteness check) read in pieces of at most 64 MiB, a transient cost on top of the snapshot.

    python bench/guard_memory.py --ddp 2,3 --sizes 1024x8 --steps 2
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any, Callable

MIB = 2**20
TARGET_SHARE = 0.05  # the target: S/N + 5% per rank
RUNS = ("safe, guard off", "safe, guard on")


def ddp_result(trainer: Any, peak: int, model_bytes: int) -> dict:
    """One rank's measurement (printed by each rank of the launch)."""
    import torch

    guard = getattr(trainer, "nan_guard", None)
    optimizer = trainer.optimizer
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    moments = [v for slot in optimizer.state.values() for v in slot.values() if torch.is_tensor(v)]
    return {
        "rank": trainer.args.process_index,
        "peak": peak,
        "model_bytes": model_bytes,
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "state_bytes": sum(t.numel() * t.element_size() for t in trainable + moments),
        "held": guard.snapshotter.held_bytes() if guard is not None and guard.snapshotter is not None else 0,
    }


def launcher(ranks: int, port: int | None = None) -> list[str]:
    """`accelerate launch` on `ranks` CPU ranks with rendezvous `port` (`None`: a free one, the OS's pick)."""
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(ranks),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
    ]  # fmt: skip


def row(ranks: int, off: list[dict], on: list[dict]) -> tuple:
    state = on[0]["state_bytes"]  # S: identical on every rank
    share = state / ranks
    extra = max(b["peak"] - a["peak"] for a, b in zip(off, on))
    held = max(r["held"] for r in on)
    target = (1 + TARGET_SHARE) * share
    return (
        str(ranks),
        f"{on[0]['params'] / 1e6:,.0f}M",
        f"{on[0]['model_bytes'] / MIB:,.0f}",
        f"{state / MIB:,.1f}",
        f"{share / MIB:,.1f}",
        f"{held / MIB:,.1f}",
        ", ".join(f"{r['peak'] / MIB:,.0f}" for r in off),
        ", ".join(f"{r['peak'] / MIB:,.0f}" for r in on),
        ", ".join(f"{(b['peak'] - a['peak']) / MIB:+,.0f}" for a, b in zip(off, on)),
        f"{(extra - held) / MIB:+,.0f}",
        f"{extra / share:.3f}",
        f"{target / MIB:,.1f}",
        "yes" if extra <= target else "NO",
    )


HEADER = [
    "ranks", "parameters", "model (MiB)", "S (MiB)", "S/N (MiB)", "snapshot held per rank (MiB)",
    "guard off, peak per rank (MiB)", "guard on, peak per rank (MiB)", "guard extra per rank (MiB)",
    "max extra beyond the snapshot (MiB)", "max extra / (S/N)", "target: S/N + 5% (MiB)", "within",
]  # fmt: skip


def ddp_main(ns: Any, run_child: Callable[[dict], dict]) -> int:
    """Measure each rank count of `ns.ddp` at the first size of `ns.sizes` (or `ns.full_sizes`), print the table."""
    from workload import markdown_table

    size = (ns.sizes or ns.full_sizes).split(",")[0]
    hidden, layers = (int(v) for v in size.split("x"))
    root = tempfile.mkdtemp(prefix="guard-memory-ddp-")
    start, rows = time.perf_counter(), []
    try:
        model = run_child({"build": [hidden, layers], "root": os.path.join(root, size)})["model"]
        for ranks in (int(v) for v in ns.ddp.split(",")):
            results = {}
            for run in RUNS:
                out = os.path.join(root, "out")
                spec = {"model": model, "method": "full", "run": run, "out": out, "steps": ns.steps}
                spec.update(batch=ns.batch, seq=ns.seq, targets=ns.lora_targets, ranks=ranks)
                spec["launcher"] = launcher(ranks, ns.master_port)
                spec["results"] = tempfile.mkdtemp(dir=root)
                results[run] = run_child(spec)["ranks"]
                shutil.rmtree(out, ignore_errors=True)
                peaks = ", ".join(f"{r['peak'] / MIB:,.0f}" for r in results[run])
                print(f"measured DDP x{ranks} {size} {run}: {peaks} MiB", file=sys.stderr, flush=True)
            rows.append(row(ranks, *(results[run] for run in RUNS)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\nDPO full fine-tune under DDP on CPU ranks (gloo), bf16 weights, batch {ns.batch} per rank, ~{ns.seq} "
        f"tokens, {ns.steps} steps, a snapshot after every step; each run a fresh launch, memory = peak RSS per rank "
        f"(listed by rank); S = the state one process's snapshot copies. MiB = 2^20 bytes. The bench took "
        f"{time.perf_counter() - start:.0f} s.\n"
    )
    print(markdown_table(HEADER, rows))
    return 0
