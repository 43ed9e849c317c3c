"""An aborted run's checkpoint holds the backed-off learning rate, and a run resumes from it. Real training on CPU,
faults injected.
"""

from __future__ import annotations

import os

import pytest
import torch
from guard_utils import read_json

import safe_trainers as st
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


def test_abort_checkpoint_holds_the_backed_off_lr_and_resumes(toy_models, tmp_path):
    fault = Fault(step=3, kind="loss", repeat=3)  # steps 3-5: three skips in a row, no rollback allowed
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[fault], nan_max_rollbacks=0
    )
    with pytest.raises(st.TrainingDivergedError) as error:
        trainer.train()
    checkpoint = error.value.checkpoint_dir
    assert checkpoint.endswith("checkpoint-5")
    optimizer = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=False)
    scheduler = torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=False)
    assert scheduler["base_lrs"] == [pytest.approx(0.5e-3)] * len(scheduler["base_lrs"])
    for group in optimizer["param_groups"]:
        assert group["lr"] == pytest.approx(0.5e-3 * (1 - 5 / 10))  # linear decay after step 5
    assert read_json(os.path.join(checkpoint, "nan_guard_state.json"))["lr_scale"] == 0.5
    # Resume as the message says: continues at the backed-off rate, to the end.
    resumed = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded")
    resumed.train(resume_from_checkpoint=checkpoint)
    lrs = {h["step"]: h["learning_rate"] for h in resumed.state.log_history if "learning_rate" in h}
    assert lrs[6] == pytest.approx(0.5e-3 * (1 - 5 / 10)) and resumed.state.global_step == 10
    # A lower learning rate passed at resume applies too (times the backoff).
    again = build_trainer("dpo", toy_models["qwen2"], tmp_path / "again", preset="guarded", learning_rate=1e-4)
    again.train(resume_from_checkpoint=checkpoint)
    lrs = {h["step"]: h["learning_rate"] for h in again.state.log_history if "learning_rate" in h}
    assert lrs[6] == pytest.approx(0.5e-4 * (1 - 5 / 10))
