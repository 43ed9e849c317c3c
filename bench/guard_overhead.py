"""Benchmark: the NaN guard's cost when nothing goes wrong, its snapshot cost, and the time to roll back.

Trains the same DPO workload with stock TRL (`trl.DPOTrainer`) and with `safe_trainers.DPOTrainer` (rules + guard
on), interleaved in one process (stock, safe, stock, safe, ...) so that both see the same machine state, and prints a
table of ratios. Absolute times are printed for reference only.

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

import safe_trainers as st  # noqa: E402
from safe_trainers.toy import build_tokenizer, model_config  # noqa: E402


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


def make_trainer(kind: str, model_dir: str, out: str, data: Dataset, steps: int, batch: int, snapshot_steps: int):
    common = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=1e-5,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        gradient_checkpointing=False,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        precompute_ref_log_probs=False,
    )
    if kind == "stock":
        return trl.DPOTrainer(model_dir, args=trl.DPOConfig(**common), train_dataset=data)
    config = st.DPOConfig(nan_snapshot_steps=snapshot_steps, **common)
    return st.DPOTrainer(model_dir, args=config, train_dataset=data)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved (stock, safe) pairs")
    parser.add_argument("--snapshot-steps", type=int, default=10, help="`nan_snapshot_steps` of the guarded runs")
    ns = parser.parse_args(argv)
    hf_logging.set_verbosity_error()
    import datasets

    datasets.disable_progress_bars()

    root = tempfile.mkdtemp(prefix="guard-bench-")
    model_dir = build_model_dir(root, ns.hidden, ns.layers)
    data = dataset(ns.steps * ns.batch, ns.seq)
    step_times = {"stock": [], "safe": []}
    snapshot_times, restore_times = [], []
    round_ratios = []
    for round_index in range(ns.rounds):
        # Alternate which runs first, and compare within a round: a paired design cancels slow drift of the machine.
        order = ("stock", "safe") if round_index % 2 == 0 else ("safe", "stock")
        medians = {}
        for kind in order:
            trainer = make_trainer(kind, model_dir, os.path.join(root, f"{kind}{round_index}"), data, ns.steps, ns.batch, ns.snapshot_steps)
            timer = StepTimer()
            trainer.add_callback(timer)
            trainer.train()
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
                    guard.snapshotter.restore(trainer.state, trainer.lr_scheduler, trainer.accelerator.scaler)
                    _sync()
                    restore_times.append(time.perf_counter() - start)

        round_ratios.append(medians["safe"] / medians["stock"])

    stock = statistics.median(step_times["stock"])
    safe = statistics.median(step_times["safe"])
    ratio = statistics.median(round_ratios)
    snapshot = statistics.median(snapshot_times)
    restore = statistics.median(restore_times)
    params = sum(p.numel() for p in trainer.model.parameters())
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"\nDPO, Qwen2-style model with {params / 1e6:.1f}M parameters, batch {ns.batch}, ~{ns.seq} tokens, {device}")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
