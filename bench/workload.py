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
from dataclasses import dataclass


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
    """The time of each optimizer step, from step begin to step end, with no synchronisation per step (a sync would
    serialise whatever the guard overlaps with the step): on a GPU, CUDA events recorded on the training stream at
    step begin and end (the device's time for the step's queued work, read once after training, [`times`]); on the
    CPU, the host clock, wall time by default (`clock=time.process_time` counts the process's CPU time instead)."""

    leaves_state_alone = True  # it only reads clocks: the guard treats it as it treats the progress bar (read_only.py)

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.events = torch.cuda.is_available() and clock is time.perf_counter
        self._times: list[float] = []
        self._marks: list[tuple] = []
        self._start: object = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = self._mark()

    def on_step_end(self, args, state, control, **kwargs):
        if self.events:
            self._marks.append((self._start, self._mark()))
        else:
            self._times.append(self.clock() - self._start)

    def _mark(self):
        if not self.events:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @property
    def times(self) -> list[float]:
        """The step times in seconds (on a GPU, read after the run: this waits for its last event)."""
        if self.events and self._marks:
            self._marks[-1][1].synchronize()
            self._times += [begin.elapsed_time(end) / 1e3 for begin, end in self._marks]
            self._marks = []
        return self._times


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_train(trainer, clock: Callable[[], float] = time.perf_counter) -> float:
    """The time of the whole `trainer.train()` call (every step, snapshot, check, log and save in it), the device's
    queued work included (one sync before and one after; none per step)."""
    _sync()
    start = clock()
    trainer.train()
    _sync()
    return clock() - start


def release() -> None:
    """Free what a finished run left (call after dropping the last reference to its trainer)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Workload:
    """A named shape of the benches' DPO run (`--workload`): the model and the batches it trains on.

    Args:
        hidden (`int`), layers (`int`): the Qwen2-style model's size ([`qwen2_config`]).
        seq (`int`): about this many tokens per sequence.
        batch (`int`): `per_device_train_batch_size`.
        vocab (`int | None`): the model's vocabulary (untied input and output embeddings); `None`: the toy
            tokenizer's (384). Rows past the tokenizer's are never fed, yet trained by AdamW (weight decay, moments)
            and copied by every snapshot, like a real model's rare tokens.
    """

    hidden: int
    layers: int
    seq: int
    batch: int
    vocab: int | None = None


WORKLOADS: dict[str, Workload] = {
    # Compute-bound on a CPU: the state (13 MB with AdamW) is small next to a ~100 ms step.
    "dpo": Workload(hidden=128, layers=4, seq=128, batch=4),
    # Memory-bound: a 64k-token vocabulary (two 16.8M-parameter embeddings, 35.5M parameters, ~430 MB of state with
    # AdamW), batch 1, ~16 tokens: the optimizer step and the snapshot's copies weigh as much next to the compute as on
    # a GPU.
    "memory-bound": Workload(hidden=256, layers=2, seq=16, batch=1, vocab=65536),
}


def apply_workload(ns) -> None:
    """Fill the size arguments left unset on the command line (`None`) from `WORKLOADS[ns.workload]`."""
    chosen = WORKLOADS[ns.workload]
    for name in ("hidden", "layers", "seq", "batch", "vocab"):
        if getattr(ns, name, None) is None:
            setattr(ns, name, getattr(chosen, name))


def qwen2_config(hidden: int, layers: int, vocab: int | None = None):
    """A Qwen2-style config: MLP 4x hidden, heads of 64, grouped-query attention (one KV head per two query heads),
    the toy tokenizer's vocabulary unless `vocab` is given (untied embeddings)."""
    return model_config(
        "qwen2",
        **({"vocab_size": vocab} if vocab else {}),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 2),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=4096,
    )


def parameter_count(hidden: int, layers: int, vocab: int | None = None) -> int:
    """Parameters of [`qwen2_config`]'s model, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen2_config(hidden, layers, vocab))
    return sum(p.numel() for p in model.parameters())


def build_model_dir(
    root: str, hidden: int, layers: int, dtype: torch.dtype | None = None, vocab: int | None = None
) -> str:
    """Build [`qwen2_config`]'s model (random weights, seed 0; stored in `dtype`, fp32 by default) and the toy
    tokenizer into `root/model`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = os.path.join(root, "model")
    AutoModelForCausalLM.from_config(qwen2_config(hidden, layers, vocab), dtype=dtype).save_pretrained(path)
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

    leaves_state_alone = True  # it only reads: the guard treats the run as one without callbacks of the user's

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


def chosen_intervals(guard) -> list[int]:
    """The snapshot intervals `guard` chose in its run, in order (its `snapshot_interval` events)."""
    return [event.detail["interval"] for event in guard.events.events if event.kind == "snapshot_interval"]


def last_interval(chosen: list[list[int]], configured: int | None) -> int:
    """The interval the last safe run ended with (else the configured one, else the guard's default of 10)."""
    ends = [run[-1] for run in chosen if run]
    return ends[-1] if ends else configured or 10


def make_trainer(
    kind: str, model_dir: str, out: str, data: Dataset, steps: int, batch: int, snapshot_steps: int | None, optim: str,
    logging_steps: int = 10, save_steps: int = 0, **safe_config,
):  # fmt: skip
    # The `"quick"` preset (lr 1e-5), scaled up; the stock run has no guard, so no `nan_snapshot_steps`.
    # `save_steps`: a checkpoint every that many steps (0: none). `safe_config`: more settings of the safe run (e.g.
    # `nan_spike_factor`).
    own = dict(trainer_cls=trl.DPOTrainer, config_cls=trl.DPOConfig) if kind == "stock" else {}
    if kind == "safe":
        own.update(nan_snapshot_steps=snapshot_steps or None, **safe_config)  # 0/None: unset, the interval adapts
    saves = dict(save_strategy="steps", save_steps=save_steps) if save_steps else dict(save_strategy="no")
    return build_trainer(
        "dpo",
        model_dir,
        out,
        dataset=data,
        max_steps=steps,
        per_device_train_batch_size=batch,
        logging_steps=logging_steps,
        bf16=torch.cuda.is_available(),
        precompute_ref_log_probs=False,
        optim=optim,
        **saves,
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
