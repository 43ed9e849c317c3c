"""Micro-benchmark: ways to check a model's state for NaN/Inf, on this machine's device (CUDA when present).

The NaN guard's state check (`safe_trainers.runtime.finite.all_finite`) must catch every NaN and Inf, raise no
false alarm on large finite values, hold at most one bounded piece beyond its inputs, and need no host sync. Each
candidate below runs over the same tensors (bf16 by default, a mix of a few large and many small tensors, like a
model's parameters), each in a fresh process so that its peak memory is its own, and the table shows its speed, the
memory it held beyond its inputs, and whether it caught a NaN and kept quiet on values near the dtype's maximum:

- `aminmax per piece`: `torch.aminmax` of each piece of at most 64 MiB (NaN propagates; no temporary);
- `max-norm, fused`: `torch._foreach_norm(ord=inf)` over the pieces (one launch on CUDA; one norm per tensor on the
  CPU);
- `isfinite per piece`: `torch.isfinite(piece).all()` (a bool temporary per piece);
- `fp32 copy + L2 norm`: the check before: an fp32 copy of every tensor, then `_foreach_norm` (an L2 norm of large
  finite values overflows: a false alarm).

    python bench/finite_check.py                 # about 1 GB of bf16 tensors
    python bench/finite_check.py --dtype float32 --megabytes 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from safe_trainers.runtime.finite import CHUNK_BYTES, flat_chunks  # noqa: E402


def _pieces(tensors):
    return [piece for t in tensors for piece in flat_chunks(t)]


def aminmax_pieces(tensors):
    return torch.isfinite(torch.stack([v for p in _pieces(tensors) for v in torch.aminmax(p)])).all()


def max_norm_fused(tensors):
    return torch.isfinite(torch.stack(torch._foreach_norm(_pieces(tensors), ord=float("inf")))).all()


def isfinite_pieces(tensors):
    return torch.stack([torch.isfinite(p).all() for p in _pieces(tensors)]).all()


def fp32_copy_l2(tensors):
    return torch.isfinite(torch.stack(torch._foreach_norm([t.float() for t in tensors]))).all()


CANDIDATES = {
    "aminmax per piece": aminmax_pieces,
    "max-norm, fused": max_norm_fused,
    "isfinite per piece": isfinite_pieces,
    "fp32 copy + L2 norm": fp32_copy_l2,
}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=1024, help="total size of the tensors checked")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def tensors_like_a_model(megabytes: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """Half the bytes in 8 large tensors, half in 1,000 small ones."""
    size = torch.tensor([], dtype=dtype).element_size()
    total = megabytes * 2**20 // size
    sizes = [total // 16] * 8 + [total // 2000] * 1000
    return [torch.empty(n, dtype=dtype, device=device).uniform_(-1, 1) for n in sizes]


def measure_one(name: str, ns) -> dict:
    torch.set_num_threads(ns.threads)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, ns.dtype)
    tensors = tensors_like_a_model(ns.megabytes, dtype, device)
    check = CANDIDATES[name]
    big = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype, device=device)
    quiet = bool(check([big]))
    before = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(ns.repeats):
        start = time.perf_counter()
        finite = bool(check(tensors))  # the host read waits for the device
        times.append(time.perf_counter() - start)
    after = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tensors[-1][3] = float("nan")
    caught = not bool(check(tensors))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {"seconds": min(times), "extra": after - before, "finite": finite, "caught": caught, "quiet": quiet,
            "nbytes": nbytes}  # fmt: skip


def main(argv=None) -> int:
    ns = parse(argv)
    if ns.one:
        print("RESULT " + json.dumps(measure_one(ns.one, ns)), flush=True)
        return 0
    from workload import device_name, markdown_table

    rows = []
    for name in CANDIDATES:
        args = [sys.executable, __file__, "--one", name, "--megabytes", str(ns.megabytes), "--dtype", ns.dtype]
        args += ["--repeats", str(ns.repeats), "--threads", str(ns.threads)]
        done = subprocess.run(args, capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode != 0 or not line:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        r = json.loads(line[-1][len("RESULT ") :])
        rows.append((
            name, f"{r['seconds'] * 1e3:.1f}", f"{r['nbytes'] / r['seconds'] / 1e9:.2f}", f"{r['extra'] / 2**20:,.0f}",
            "yes" if r["caught"] else "NO", "yes" if r["quiet"] else "NO (false alarm)",
        ))  # fmt: skip
    print(
        f"\n{ns.megabytes} MiB of {ns.dtype} tensors (8 large, 1,000 small) on {device_name()}, "
        f"{ns.threads} torch thread(s); pieces of at most {CHUNK_BYTES // 2**20} MiB; time = best of {ns.repeats}; "
        "extra = peak memory held beyond the tensors (fresh process each).\n"
    )
    header = ["check", "time (ms)", "GB/s", "extra peak (MiB)", "catches a NaN", "quiet on large finite values"]
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
