"""`runtime/copy_stream.py` on the CPU: where a snapshot's copies run (`copy_route`), which completed wait
`copy_delay_seconds` reports, and the trainer's writes of the state that wait for a snapshot's copies
(`HostSnapshot.before_write`). The CUDA side (the side stream, the device waits, the overlap) is in
`tests/gpu/test_gpu_copy_overlap.py`."""

from __future__ import annotations

import torch

from safe_trainers.guard.rollback.memory import HostSnapshot
from safe_trainers.runtime.copy_stream import HOST, SIDE, TRAINING, CopyStream, copy_route, newest_done
from safe_trainers.runtime.host_buffers import HostBuffers
from safe_trainers.testing.build import build_trainer

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


def test_the_copies_overlap_only_from_one_cuda_device_outside_deepspeed():
    assert copy_route([]) == HOST and copy_route([CPU, CPU]) == HOST  # synchronous host copies
    assert copy_route([GPU0]) == SIDE
    assert copy_route([GPU0, CPU]) == SIDE  # a non-fused AdamW's `step` counters live on the CPU
    assert copy_route([GPU0, GPU1]) == TRAINING  # a model spread over devices: on the training stream, as before
    for stage in (1, 2, 3):  # ZeRO steps inside `backward`, where nothing can wait before the update
        assert copy_route([GPU0], zero_stage=stage) == TRAINING
    assert copy_route([CPU], zero_stage=3) == HOST


def test_newest_done_is_the_newest_completed_wait():
    assert newest_done([], bool) is None
    assert newest_done([True, True, False], bool) == 1
    assert newest_done([True, False, True], bool) == 2
    assert newest_done([False, False], bool) is None


class TimedWait:
    """The timing events' side of one timed wait: completed or not, and its length in milliseconds."""

    def __init__(self, ms: float):
        self.ms, self.completed = ms, False

    def query(self) -> bool:
        return self.completed

    def elapsed_time(self, end: TimedWait) -> float:
        return end.ms


def test_the_delay_is_the_newest_completed_wait_and_never_waits_for_one():
    copies = CopyStream()
    copies.route = SIDE
    first, second = TimedWait(12.0), TimedWait(3.0)
    copies.timings.extend([(TimedWait(0), first), (TimedWait(0), second)])
    assert copies.delay_seconds() is None  # nothing completed yet: not known, and not waited for
    first.completed = True
    assert copies.delay_seconds() == 0.012 and len(copies.timings) == 1  # read once, then dropped
    assert copies.delay_seconds() == 0.012  # the second still runs: the last known stays
    second.completed = True
    assert copies.delay_seconds() == 0.003 and not copies.timings


def test_host_copies_are_synchronous_with_no_delay_and_nothing_to_wait_for():
    copies, buffers = CopyStream(), HostBuffers()
    assert copies.delay_seconds() == 0.0  # no CUDA here
    source = {"w": torch.arange(4.0), "step": 3}
    held, ready = copies.copy(source, buffers)
    assert ready is None and copies.route == HOST and copies.pending is None
    source["w"].add_(1)
    assert torch.equal(held["w"], torch.arange(4.0)) and held["step"] == 3
    copies.before_write()  # nothing in flight: nothing to do
    assert copies.delay_seconds() == 0.0


def test_every_update_and_the_end_of_train_wait_for_the_snapshots_copies(toy_models, tmp_path, monkeypatch):
    """The trainer calls `before_write` before each optimizer step and when `train()` ends, and the best model's load
    waits too: the writes a snapshot's copies in flight on a GPU must finish before."""
    trainer = build_trainer(
        "sft", toy_models["qwen2"], tmp_path / "out", preset="guarded", max_steps=4, save_steps=2, eval_rows=4,
        eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
    )  # fmt: skip
    writes: list[tuple[int, str]] = []
    real_before_write = HostSnapshot.before_write

    def before_write(self):
        writes.append((trainer.state.global_step, "before_write"))
        real_before_write(self)

    def load_best():
        writes.append((trainer.state.global_step, "load_best"))
        real_load_best()

    monkeypatch.setattr(HostSnapshot, "before_write", before_write)
    real_load_best = trainer._load_best_model
    monkeypatch.setattr(trainer, "_load_best_model", load_best)
    trainer.train()
    # before each of the 4 updates (at global_step 0..3), before the best model's load, and when `train()` ends
    assert writes == [(0, "before_write"), (1, "before_write"), (2, "before_write"), (3, "before_write"),
                      (4, "load_best"), (4, "before_write"), (4, "before_write")]  # fmt: skip
    assert trainer.nan_guard.snapshotter.copy_delay_seconds() == 0.0  # CPU copies: synchronous, timed by the host
