"""The DPO workload the guard benches share: a Qwen2-style model built from a config, toy preference data, stock and
safe trainers on them, and the probes the benches read (step timer, memory held by the guard, snapshot timing).

Used by `guard_overhead.py` (overhead at one size), `gpu_overhead.py` (the same on a GPU, 0.5B parameters),
`guard_scaling.py` (the cost over model sizes) and `guard_memory.py` (peak memory over model sizes); its tables also
by `preemption_cost.py`, `restart_cost.py`, `finite_check.py` and `spike_false_skips.py`. Not a benchmark itself.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable


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
    """The time of each optimizer step, from step begin to step end, device work included: wall time by default;
    `clock=time.process_time` counts the process's CPU time instead (CPU-only runs on a shared machine)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self._start = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.times.append(self.clock() - self._start)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release() -> None:
    """Free what a finished run left (call after dropping the last reference to its trainer)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def qwen2_config(hidden: int, layers: int):
    """A Qwen2-style config: MLP 4x hidden, heads of 64, grouped-query attention (one KV head per two query heads),
    the toy tokenizer's vocabulary."""
    return model_config(
        "qwen2",
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 2),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=4096,
    )


def parameter_count(hidden: int, layers: int) -> int:
    """Parameters of [`qwen2_config`]'s model, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen2_config(hidden, layers))
    return sum(p.numel() for p in model.parameters())


def build_model_dir(root: str, hidden: int, layers: int, dtype: torch.dtype | None = None) -> str:
    """Build [`qwen2_config`]'s model (random weights, seed 0; stored in `dtype`, fp32 by default) and the toy
    tokenizer into `root/model`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = os.path.join(root, "model")
    AutoModelForCausalLM.from_config(qwen2_config(hidden, layers), dtype=dtype).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def dataset(n: int, seq: int) -> Dataset:
    words = "the cat is good and the dog is bad".split()
    half = max(seq // 2, 4)
    prompt = " ".join(words[i % len(words)] for i in range(half))
    row = {"prompt": prompt, "chosen": " yes good" * (half // 2), "rejected": " no bad" * (half // 2)}
    return Dataset.from_list([row] * n)


class GuardMemoryProbe(TrainerCallback):
    """The largest number of bytes the guard held in host copies of micro-batches, and in device tensors (its
    per-step flags and loss sums), seen just before each optimizer step."""

    def __init__(self, guard):
        self.guard = guard
        self.batch_bytes = 0
        self.device_bytes = 0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.batch_bytes = max(self.batch_bytes, self.guard.batches.nbytes())
        flags = [t for step in self.guard.flags.pending for t in step[1:] if torch.is_tensor(t) and t.is_cuda]
        self.device_bytes = max(self.device_bytes, sum(t.numel() * t.element_size() for t in flags))


def _snapshot_tensors(snapshot) -> list[torch.Tensor]:
    from safe_trainers.runtime.nested import tensors as nested_tensors

    tensors = list(snapshot.params.values())
    tensors += [t for slot in snapshot.optimizer_state.values() for t in nested_tensors(slot)]
    return tensors + list(nested_tensors(snapshot.deepspeed_state))


def snapshot_bytes(snapshot) -> int:
    """Host bytes held by a snapshot (weights and optimizer state)."""
    return sum(t.numel() * t.element_size() for t in _snapshot_tensors(snapshot))


def pinned_bytes(snapshot) -> int:
    """The part of [`snapshot_bytes`] in pinned (page-locked) host memory: all of it on a GPU machine."""
    return sum(t.numel() * t.element_size() for t in _snapshot_tensors(snapshot) if t.is_pinned())


def time_snapshot(
    trainer, repeats: int = 3, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[float], list[float]]:
    """Times of `repeats` state checks + snapshots (until the copies have landed) and of as many restores."""
    guard = trainer.nan_guard
    taken, restored = [], []
    for _ in range(repeats):
        _sync()
        start = clock()
        assert guard.state_is_finite()  # a snapshot is always preceded by this check
        guard.take_snapshot()
        guard.snapshotter.snapshot.wait()
        taken.append(clock() - start)
        _sync()
        start = clock()
        guard.snapshotter.restore(trainer.state)
        _sync()
        restored.append(clock() - start)
    return taken, restored


def make_trainer(
    kind: str, model_dir: str, out: str, data: Dataset, steps: int, batch: int, snapshot_steps: int, optim: str,
    **safe_config,
):  # fmt: skip
    # The `"quick"` preset (lr 1e-5), scaled up; the stock run has no guard, so no `nan_snapshot_steps`.
    # `safe_config`: more settings of the safe run (e.g. `nan_spike_factor`).
    own = dict(trainer_cls=trl.DPOTrainer, config_cls=trl.DPOConfig) if kind == "stock" else {}
    if kind == "safe":
        own.update(nan_snapshot_steps=snapshot_steps, **safe_config)
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


def quiet() -> None:
    import datasets

    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"


def markdown_table(header: list[str], rows: list[tuple]) -> str:
    """A markdown table, columns padded to their widest cell; the first column left-aligned, the others right."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        padded = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "-" * (widths[0] + 2) + "|" + "".join("-" * (w + 1) + ":|" for w in widths[1:])
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def time_table(rows: list[tuple[str, float]], unit: str = "s") -> str:
    """A markdown table of measured times: `rows` are `(measure, seconds)`, shown in seconds or microseconds."""
    scale, digits = {"s": (1.0, 2), "us": (1e6, 1)}[unit]
    return markdown_table(["measure", "time"], [(name, f"{value * scale:.{digits}f} {unit}") for name, value in rows])
