"""Benchmark: the NaN guard's cost when nothing goes wrong, its snapshot cost, the time to roll back, and the memory
it holds.

Trains the same DPO workload with stock TRL (`trl.DPOTrainer`) and with `safe_trainers.DPOTrainer` (rules + guard
on), interleaved in one process (stock, safe, stock, safe, ...) so that both see the same machine state, and prints a
table of ratios, once with the fused AdamW transformers uses by default (the guard skips on the device) and once with
the non-fused `adamw_torch` (the guard reads its flag on the host each step). Absolute times are for reference only.

    python bench/guard_overhead.py                      # CPU: a model whose DPO step takes ~100 ms here
    python bench/guard_overhead.py --hidden 1024 --layers 8 --seq 512 --batch 8   # e.g. on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from safe_trainers.testing.build import build_trainer  # noqa: E402
from safe_trainers.testing.toy import build_tokenizer, model_config  # noqa: E402


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (from step begin to step end, device work included)."""

    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.times.append(time.perf_counter() - self._start)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model_dir(root: str, hidden: int, layers: int) -> str:
    from transformers import AutoModelForCausalLM

    config = model_config(
        "qwen2",
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 2),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    path = os.path.join(root, "model")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def dataset(n: int, seq: int) -> Dataset:
    words = "the cat is good and the dog is bad".split()
    half = max(seq // 2, 4)
    prompt = " ".join(words[i % len(words)] for i in range(half))
    rows = [{"prompt": prompt, "chosen": " yes good" * (half // 2), "rejected": " no bad" * (half // 2)} for _ in range(n)]
    return Dataset.from_list(rows)


class GuardMemoryProbe(TrainerCallback):
    """The largest number of bytes the guard held in host copies of micro-batches, and in device tensors (its
    per-step flags and loss sums), seen just before each optimizer step."""

    def __init__(self, guard):
        self.guard = guard
        self.batch_bytes = 0
        self.device_bytes = 0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        held = self.guard.batches.nbytes() + sum(_nbytes(b) for b in self.guard.batches._current)
        self.batch_bytes = max(self.batch_bytes, held)
        flags = [t for p in self.guard._pending for t in p[1:] if torch.is_tensor(t) and t.device.type != "cpu"]
        self.device_bytes = max(self.device_bytes, sum(t.numel() * t.element_size() for t in flags))


def _nbytes(value) -> int:
    from safe_trainers.guard.localize import _tensors

    return sum(t.numel() * t.element_size() for t in _tensors(value))


def snapshot_bytes(snapshot) -> int:
    total = sum(t.numel() * t.element_size() for t in snapshot.params.values())
    total += sum(_nbytes(slot) for slot in snapshot.optimizer_state.values())
    return total + _nbytes(snapshot.deepspeed_state)


def make_trainer(
    kind: str, model_dir: str, out: str, data: Dataset, steps: int, batch: int, snapshot_steps: int, optim: str
):
    # The `"quick"` preset (lr 1e-5), scaled up; the stock run has no guard, so no `nan_snapshot_steps`.
    own = dict(trainer_cls=trl.DPOTrainer, config_cls=trl.DPOConfig) if kind == "stock" else {}
    if kind == "safe":
        own["nan_snapshot_steps"] = snapshot_steps
    return build_trainer(
        "dpo",
        model_dir,
        out,
        dataset=data,
        max_steps=steps,
        per_device_train_batch_size=batch,
        logging_steps=10,
        bf16=torch.cuda.is_available(),
        precompute_ref_log_probs=False,
        optim=optim,
        **own,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved (stock, safe) pairs")
    parser.add_argument("--snapshot-steps", type=int, default=10, help="`nan_snapshot_steps` of the guarded runs")
    parser.add_argument("--optims", default="adamw_torch_fused,adamw_torch", help="comma-separated `optim` values")
    ns = parser.parse_args(argv)
    hf_logging.set_verbosity_error()
    import datasets

    datasets.disable_progress_bars()

    root = tempfile.mkdtemp(prefix="guard-bench-")
    model_dir = build_model_dir(root, ns.hidden, ns.layers)
    data = dataset(ns.steps * ns.batch, ns.seq)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    for optim in ns.optims.split(","):
        measure(ns, optim, root, model_dir, data, device)
    return 0


def measure(ns, optim: str, root: str, model_dir: str, data: Dataset, device: str) -> None:
    step_times = {"stock": [], "safe": []}
    peak_memory = {"stock": [], "safe": []}
    snapshot_times, restore_times = [], []
    round_ratios = []
    probe = None
    for round_index in range(ns.rounds):
        # Alternate which runs first, and compare within a round: a paired design cancels slow drift of the machine.
        order = ("stock", "safe") if round_index % 2 == 0 else ("safe", "stock")
        medians = {}
        for kind in order:
            out = os.path.join(root, f"{optim}-{kind}{round_index}")
            trainer = make_trainer(kind, model_dir, out, data, ns.steps, ns.batch, ns.snapshot_steps, optim)
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
                guard = trainer.nan_guard
                for _ in range(3):
                    _sync()
                    start = time.perf_counter()
                    assert guard.state_is_finite()  # a snapshot is always preceded by this check
                    guard.take_snapshot()
                    guard.snapshotter.snapshot.wait()
                    snapshot_times.append(time.perf_counter() - start)
                    _sync()
                    start = time.perf_counter()
                    guard.snapshotter.restore(trainer.state)
                    _sync()
                    restore_times.append(time.perf_counter() - start)
                held_snapshot = snapshot_bytes(guard.snapshotter.snapshot)
        round_ratios.append(medians["safe"] / medians["stock"])

    stock = statistics.median(step_times["stock"])
    safe = statistics.median(step_times["safe"])
    ratio = statistics.median(round_ratios)
    snapshot = statistics.median(snapshot_times)
    restore = statistics.median(restore_times)
    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"\nDPO, Qwen2-style model with {params / 1e6:.1f}M parameters, batch {ns.batch}, ~{ns.seq} tokens, {device}, "
          f"optim={optim}")
    print(
        f"{ns.rounds} interleaved rounds x {ns.steps} steps each; step times are medians over "
        f"{len(step_times['safe'])} steps, the ratio is the median of the per-round ratios "
        f"({', '.join(f'{r:.3f}' for r in round_ratios)})\n"
    )
    rows = [
        ("step time, stock TRL (reference)", f"{stock * 1e3:.1f} ms", "1.000"),
        ("step time, safe_trainers (guard on)", f"{safe * 1e3:.1f} ms", f"{ratio:.3f}"),
        (f"check + snapshot (every {ns.snapshot_steps} steps)", f"{snapshot * 1e3:.1f} ms", f"{snapshot / stock:.3f} of a step"),
        ("snapshot, amortised per step", f"{snapshot / ns.snapshot_steps * 1e3:.2f} ms", f"{snapshot / ns.snapshot_steps / stock:.4f}"),
        ("rollback (restore the snapshot)", f"{restore * 1e3:.1f} ms", f"{restore / stock:.3f} of a step"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"| {'measure':<{width}} | {'time':>10} | {'ratio to a stock step':>21} |")
    print(f"|{'-' * (width + 2)}|{'-' * 12}|{'-' * 23}|")
    for name, value, shown in rows:
        print(f"| {name:<{width}} | {value:>10} | {shown:>21} |")
    print(f"\noverhead with the guard on: {(ratio - 1) * 100:+.2f}% of step time (goal: < 1%); "
          f"rollback = {restore / stock:.2f} steps (goal: < 2)")
    mib = 1024**2
    print("\nmemory held by the guard")
    print(f"  host, snapshot (weights + optimizer state): {held_snapshot / mib:.2f} MiB")
    print(f"  host, micro-batch copies for diagnosis (peak): {probe.batch_bytes / mib:.3f} MiB")
    if torch.cuda.is_available():
        extra = statistics.median(peak_memory["safe"]) - statistics.median(peak_memory["stock"])
        print(f"  device, flags and loss sums (peak): {probe.device_bytes} bytes; "
              f"peak device memory, safe - stock: {extra / mib:+.2f} MiB")
    else:
        print(f"  device: none beyond {probe.device_bytes} bytes of flags (CPU run: host and device are the same memory)")


if __name__ == "__main__":
    sys.exit(main())
