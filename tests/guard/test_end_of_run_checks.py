"""The last step is checked and snapshotted once (issue 30, item 1): when `max_steps` is a multiple of
`nan_snapshot_steps`, the step's own boundary (`on_step_end`) and the epoch's end (`on_epoch_end`) fall on the same
step, a save there verified the state afresh, and `train()` checked it once more when it returned. With only
callbacks that cannot change the state (transformers' flow and printer, the run's own), the state verified at the last
step is the state `train()` returns: one check there and no copy (no step is left to roll back), none after. A callback
that can change the state keeps every check (`test_damage_after_the_last_check.py`)."""

from __future__ import annotations

import pytest
from transformers import TrainerCallback

from safe_trainers.testing.build import build_trainer


class Calls:
    """The `global_step` of each call to one of the guard's methods, counted on the guard object itself."""

    def __init__(self, trainer, name: str):
        self.steps: list[int] = []
        guard, method = trainer.nan_guard, getattr(trainer.nan_guard, name)

        def counted(*args, **kwargs):
            self.steps.append(guard.port.state.global_step)
            return method(*args, **kwargs)

        setattr(guard, name, counted)


class Reader(TrainerCallback):
    """A callback of the user's that could change the state (it reads only, but the guard cannot know that)."""


@pytest.mark.parametrize("save_steps", [None, 4], ids=["no_save", "save_at_the_end"])
def test_the_last_step_is_checked_and_snapshotted_once(toy_models, tmp_path, save_steps):
    saves = dict(save_strategy="steps", save_steps=save_steps) if save_steps else dict(save_strategy="no")
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, max_steps=4, nan_snapshot_steps=2, nan_snapshot_budget=0.0,
        logging_steps=1, **saves,
    )
    checks, snapshots = Calls(trainer, "state_is_finite"), Calls(trainer, "take_snapshot")
    trainer.train()
    assert trainer.state.global_step == 4
    assert checks.steps == [0, 2, 4]  # the start, the snapshot at step 2, the last step: nothing twice
    assert snapshots.steps == [0, 2]  # the last step is verified, not copied: no step is left to roll back from


def test_a_callback_that_may_change_the_state_keeps_the_checks_after_the_last_one(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, max_steps=4, nan_snapshot_steps=2, nan_snapshot_budget=0.0,
        save_strategy="no",
    )
    trainer.add_callback(Reader())
    checks = Calls(trainer, "state_is_finite")
    trainer.train()
    assert checks.steps == [0, 2, 4, 4, 4]  # `on_step_end`, `on_epoch_end`, when `train()` returns
