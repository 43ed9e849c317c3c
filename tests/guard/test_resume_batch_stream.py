"""A run resumed from a checkpoint written after a rollback continues the batch stream where the kept timeline left it.
Real training on CPU, faults injected.
"""

from __future__ import annotations

import shutil

import pytest
from guard_utils import recording

import safe_trainers as st
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_resume_after_rollback_continues_the_batch_stream(toy_models, tmp_path, kind):
    faults = [Fault(step=3, kind="weight")]  # rollback at step 3, before checkpoint-4
    cls = recording(st.DPOTrainer if kind == "dpo" else st.GRPOTrainer)
    reference = build_trainer(
        kind, toy_models["qwen2"], tmp_path / "ref", preset="guarded", faults=faults, trainer_cls=cls, max_steps=8
    )
    reference.train()
    # GRPO verifies the weights before sampling step 3's completions: a rollback before any NaN loss.
    expected = ["rollback"] if kind == "grpo" else ["skip", "rollback"]
    assert [e["kind"] for e in read_events(str(tmp_path / "ref"))] == expected
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ref" / "checkpoint-4", resumed_dir / "checkpoint-4")
    resumed = build_trainer(
        kind, toy_models["qwen2"], str(resumed_dir), preset="guarded", faults=faults, trainer_cls=cls, max_steps=8
    )
    resumed.train(resume_from_checkpoint=str(resumed_dir / "checkpoint-4"))
    assert resumed.seen == [s for s in reference.seen if s[0] > 4]  # no batch twice, none lost
    assert resumed.state.global_step == 8 and resumed.nan_guard.state.rollbacks == 1  # counters came back
