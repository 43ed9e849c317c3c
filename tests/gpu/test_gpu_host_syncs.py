"""Host-device synchronisations in the guard's per-step hot path: none with the default fused optimizer, in bf16 and
under the fp16 loss scaler, with a faulted step skipped on the device.

The guard's per-step calls (the trainer's `compute_loss`, `training_step` and `_get_grad_norm` hand it the inputs,
the loss and the gradient norm; its callback hands the skip flag to the optimizer and checks, at each step end,
whether an inspection is due) run under a [`SyncWatch`]: CUDA's sync debug mode raises on implicit synchronisations,
and `torch.cuda.synchronize()`, `Event.synchronize()`, `Stream.synchronize()` and `torch.distributed` waits are
counted. Inspections (log, save, evaluation, every `nan_snapshot_steps`, the last step) read the flags back by
design: the run logs and snapshots past its end, so every step but the last is a pure hot-path step. A NaN loss at
step 3 is skipped without any host read: its weights and optimizer step counts are those of before the step. A
snapshot's copies run on a side stream, and the update after it waits for them on the device: watched too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sync_watch import SyncWatch

from safe_trainers.guard.rollback.memory import HostSnapshot
from safe_trainers.runtime.copy_stream import SIDE
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault

from gpu_utils import StepStates


MAX_STEPS = 6
FAULT_STEP = 3
HOT_PATH = ("record_inputs", "observe_loss", "end_of_step", "apply_skip", "due")


def watch_guard(trainer, monkeypatch) -> SyncWatch:
    """Watch the guard's hot-path methods; the last step's `due`, which has it inspected, runs unwatched."""
    watch = SyncWatch(monkeypatch)
    # `train()` makes a new `trainer.state`: read it at each call
    watch.watch_methods(
        trainer.nan_guard, HOT_PATH, unless=lambda: trainer.state.global_step >= trainer.state.max_steps
    )
    return watch


def hot_path_trainer(toy_models, tmp_path, **overrides):
    return build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        rows=2 * MAX_STEPS,
        max_steps=MAX_STEPS,
        logging_steps=MAX_STEPS + 1,
        faults=[Fault(step=FAULT_STEP, kind="loss")],
        **{"bf16": True, "nan_snapshot_steps": MAX_STEPS + 1, **overrides},
    )


def test_the_watch_sees_explicit_waits_and_implicit_syncs(monkeypatch):
    # The control of the watch itself: each explicit wait is counted, an implicit sync raises, nothing outside counts.
    watch = SyncWatch(monkeypatch)
    event = torch.cuda.Event()
    event.record()
    torch.cuda.synchronize()  # unwatched
    with watch.watching():
        torch.cuda.synchronize()
        event.synchronize()
        torch.cuda.current_stream().synchronize()
    assert watch.explicit == [
        "torch.cuda.synchronize",
        "torch.cuda.Event.synchronize",
        "torch.cuda.Stream.synchronize",
    ]
    with pytest.raises(RuntimeError, match="synchroniz"), watch.watching():
        torch.ones((), device="cuda").item()


def test_the_watch_sees_collective_waits(monkeypatch, tmp_path):
    # A one-rank gloo group: a barrier and the wait on an all-reduce's handle are host waits.
    watch = SyncWatch(monkeypatch)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with watch.watching():
            dist.barrier()
            dist.all_reduce(torch.ones(1), async_op=True).wait()
    finally:
        dist.destroy_process_group()
    # (`barrier` waits on its own handle too: each wait is listed)
    assert watch.explicit[0] == "torch.distributed.barrier" and watch.explicit[-1] == "torch.distributed.Work.wait"
    assert set(watch.explicit) == {"torch.distributed.barrier", "torch.distributed.Work.wait"}


@pytest.mark.parametrize(
    "precision",
    [
        {"bf16": True},
        # The spike detector's window (judged and updated on the device at every step, warm-up or not).
        {"bf16": True, "nan_spike_factor": 6.0},
        # fp16 with the real CUDA loss scaler: the fault goes into the scaler's own `found_inf`, on the device.
        {"bf16": False, "fp16": True, "safety_disable_rules": ["precision.bf16_over_fp16"]},
    ],
    ids=["bf16", "bf16-spikes", "fp16-loss-scaler"],
)
def test_no_host_sync_per_step_and_the_fault_is_skipped_on_the_device(toy_models, tmp_path, monkeypatch, precision):
    trainer = hot_path_trainer(toy_models, tmp_path, **precision)
    assert trainer.args.optim == "adamw_torch_fused"  # transformers' default with torch >= 2.8
    scaler = trainer.accelerator.scaler
    assert (scaler is not None) == precision.get("fp16", False)
    states = StepStates(scaler)
    trainer.add_callback(states)
    watch = watch_guard(trainer, monkeypatch)
    trainer.train()  # raises if any watched call synchronises implicitly
    assert watch.calls == {name: MAX_STEPS for name in HOT_PATH} | {"due": MAX_STEPS - 1}
    assert watch.explicit == []
    assert (FAULT_STEP, "loss") in trainer.fault_injector.injected
    guard = trainer.nan_guard.state
    assert (guard.skipped_steps, guard.rollbacks, trainer.state.global_step) == (1, 0, MAX_STEPS)
    assert guard.spike_steps == 0
    # The faulted step changed no weight and no optimizer step count; the steps around it trained.
    assert states.unchanged(FAULT_STEP)
    assert any(states.applied(step) for step in range(2, MAX_STEPS + 1) if step != FAULT_STEP)
    assert "found_inf" not in vars(trainer.optimizer.optimizer)


def test_the_update_after_a_snapshot_waits_for_its_copies_on_the_device_only(toy_models, tmp_path, monkeypatch):
    # A snapshot every 2 steps: its copies run on a side stream, and the first update after it waits for them
    # (`HostSnapshot.before_write`, watched like the hot path): a device wait, no host synchronisation.
    trainer = hot_path_trainer(toy_models, tmp_path, nan_snapshot_steps=2, nan_snapshot_budget=0.0)  # exactly every 2
    watch = watch_guard(trainer, monkeypatch)
    in_flight: list[int] = []
    real_before_write = HostSnapshot.before_write

    def before_write(self):
        if self.copies.pending is not None:
            in_flight.append(trainer.state.global_step)
        with watch.watching():
            real_before_write(self)

    monkeypatch.setattr(HostSnapshot, "before_write", before_write)
    trainer.train()  # raises if a watched call synchronises implicitly
    assert watch.explicit == []
    snapshotter = trainer.nan_guard.snapshotter
    assert snapshotter.copies.route == SIDE
    assert in_flight[:3] == [0, 2, 4]  # the snapshots of train start, steps 2 and 4, waited for by the next update
    # Read back without a synchronisation once the device passed the wait (the check after training read it back).
    delay = snapshotter.copy_delay_seconds()
    assert delay is not None and delay >= 0.0


def test_the_watch_catches_the_host_read_of_a_non_fused_optimizer(toy_models, tmp_path, monkeypatch):
    # The control: a non-fused AdamW cannot skip on the device, so the guard reads its flag on the host each step.
    trainer = hot_path_trainer(toy_models, tmp_path, optim="adamw_torch")
    watch_guard(trainer, monkeypatch)
    with pytest.raises(RuntimeError, match="synchroniz"):
        trainer.train()
