"""The logs report the applied steps only and never rewind or invent a value. Real training on CPU, faults injected.
"""

from __future__ import annotations

import math

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


def test_logs_report_applied_steps_and_never_rewind(toy_models, tmp_path):
    faults = [Fault(step=4, kind="weight"), Fault(step=9, kind="loss")]
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        faults=faults,
        logging_steps=4,
        include_num_input_tokens_seen="all",
    )
    output = trainer.train()
    history = trainer.state.log_history
    losses = {h["step"]: h["loss"] for h in history if "loss" in h}
    assert sorted(losses) == [4, 8]  # steps 9-10 (with the skipped step 9) are only in `train_loss`
    assert all(math.isfinite(v) and v != 0.0 for v in losses.values())  # step 4 skipped, still a real mean
    steps = [h["step"] for h in history if "loss" in h]
    assert steps == sorted(set(steps))  # no step number logged twice
    tokens = [h["num_input_tokens_seen"] for h in history if "num_input_tokens_seen" in h]
    assert tokens == sorted(tokens) and trainer.state.num_input_tokens_seen == max(tokens)  # never rewound
    assert math.isfinite(output.training_loss) and output.training_loss == history[-1]["train_loss"]
