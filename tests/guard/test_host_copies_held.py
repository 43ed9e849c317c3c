"""The guard keeps host copies of only the steps it has not inspected yet. Real training on CPU.
"""

from __future__ import annotations

import torch
import trl

from safe_trainers.testing.build import build_trainer


def test_guard_keeps_only_host_copies_of_the_uninspected_steps(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        max_steps=3,
        logging_steps=100,
        nan_snapshot_steps=100,
        save_strategy="no",
        gradient_accumulation_steps=2,
    )
    held = []
    trainer.add_callback(
        type(
            "Probe",
            (trl.trainer.callbacks.TrainerCallback,),
            {
                "on_step_end": lambda self, args, state, control, **kw: held.append(
                    (len(trainer.nan_guard.batches._steps), trainer.nan_guard.batches.nbytes())
                )
            },
        )()
    )
    trainer.train()
    # Steps 1-2 accumulate (no inspection due); the last step is inspected, which drops them.
    assert [n for n, _ in held[:2]] == [1, 2] and held[1][1] > 0
    assert all(
        t.device.type == "cpu"
        for b in trainer.nan_guard.batches._steps.values()
        for x in b
        for t in x.values()
        if torch.is_tensor(t)
    )
    assert trainer.nan_guard.batches.nbytes() == 0
