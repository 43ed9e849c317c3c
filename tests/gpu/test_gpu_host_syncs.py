"""Host-device synchronisations in the guard's per-step hot path: none with the default fused optimizer.

The guard's per-step calls (the trainer's `compute_loss`, `training_step` and `_get_grad_norm` hand it the inputs,
the loss and the gradient norm; its callback hands the skip flag to the optimizer and checks, at each step end,
whether an inspection is due) run under `torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronising
CUDA call. Inspections (log, save, evaluation, every `nan_snapshot_steps`, the last step) read the flags back by
design: the run logs and snapshots past its end, so every step but the last is a pure hot-path step.
"""

from __future__ import annotations

import pytest
import torch

from safe_trainers.testing.build import build_trainer


MAX_STEPS = 6
HOT_PATH = ("record_inputs", "observe_loss", "end_of_step", "apply_skip", "at_boundary")


class SyncWatch:
    """Wraps the hot-path methods of one [`NanGuard`] so that they run with synchronisations raising, and counts the
    calls made so. The last step's `at_boundary`, which inspects, runs unwatched."""

    def __init__(self, guard):
        self.calls = dict.fromkeys(HOT_PATH, 0)
        for name in HOT_PATH:
            setattr(guard, name, self._watched(guard, name, getattr(guard, name)))

    def _watched(self, guard, name, method):
        def run(*args, **kwargs):
            state = guard.trainer.state
            if state.global_step >= state.max_steps:
                return method(*args, **kwargs)
            torch.cuda.set_sync_debug_mode("error")
            try:
                result = method(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            self.calls[name] += 1
            return result

        return run


def hot_path_trainer(toy_models, tmp_path, **overrides):
    return build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        rows=2 * MAX_STEPS,
        max_steps=MAX_STEPS,
        bf16=True,
        logging_steps=MAX_STEPS + 1,
        nan_snapshot_steps=MAX_STEPS + 1,
        **overrides,
    )


def test_no_host_sync_per_step_with_the_default_fused_optimizer(toy_models, tmp_path):
    trainer = hot_path_trainer(toy_models, tmp_path)
    assert trainer.args.optim == "adamw_torch_fused"  # transformers' default with torch >= 2.8
    watch = SyncWatch(trainer.nan_guard)
    trainer.train()  # raises if any watched call synchronises
    per_step = {name: MAX_STEPS for name in HOT_PATH} | {"at_boundary": MAX_STEPS - 1}
    assert watch.calls == per_step
    assert trainer.nan_guard.state.skipped_steps == 0


def test_the_watch_catches_the_host_read_of_a_non_fused_optimizer(toy_models, tmp_path):
    # The control: a non-fused AdamW cannot skip on the device, so the guard reads its flag on the host each step.
    trainer = hot_path_trainer(toy_models, tmp_path, optim="adamw_torch")
    SyncWatch(trainer.nan_guard)
    with pytest.raises(RuntimeError, match="synchroniz"):
        trainer.train()
