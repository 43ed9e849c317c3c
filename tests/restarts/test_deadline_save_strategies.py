"""The deadline's margin holds the measured save time (`restarts/deadline.py`) whatever triggers the save: a save at
an epoch's end or at a new best metric is timed like one at `save_steps` (found in review)."""

from __future__ import annotations

import time

import pytest

from safe_trainers.testing.build import build_trainer

STRATEGIES = {
    "epoch": dict(save_strategy="epoch", num_train_epochs=2, max_steps=-1),
    "best": dict(save_strategy="best", max_steps=4, eval_strategy="steps", eval_steps=2,
                 metric_for_best_model="eval_loss", greater_is_better=True),
}  # fmt: skip


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_save_is_timed_for_the_deadline(toy_models, tmp_path, strategy, background):
    trainer = build_trainer(
        "sft", toy_models["qwen2"], str(tmp_path), preset="guarded", rows=6, eval_rows=4 if strategy == "best" else 0,
        save_in_background=background, job_end_time=time.time() + 3600, **STRATEGIES[strategy],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step > 0 and trainer.safe_run.hooks_ran.steps.get("_save_checkpoint")
    deadline = trainer.safe_run.preemption.deadline
    assert deadline.save_seconds is not None  # measured, not the assumed write rate of the state's bytes
