"""With gradient accumulation, the diagnosis names the faulty micro-batch. Real training on CPU, faults injected.
"""

from __future__ import annotations

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events


def test_diagnosis_finds_the_faulty_micro_batch(toy_models, tmp_path):
    fault = Fault(step=3, kind="loss", micro_batch=1)
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[fault], gradient_accumulation_steps=2
    )
    trainer.train()
    skip = read_events(str(tmp_path))[0]
    assert skip["kind"] == "skip" and skip["first_nonfinite_module"]["micro_batch"] == 1
    assert skip["first_nonfinite_module"]["module"].endswith("layers.1")
