"""Review of the replay bundles (docs/replay.md): what the extra diagnosis of every faulted inspection must not
change, and the edges of the bundles on disk."""

from __future__ import annotations

import torch

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.testing.toy import save_toy_model


def _final_weights(model: str, out: str, **config) -> dict[str, torch.Tensor]:
    faults = [Fault(step=3, kind="loss"), Fault(step=7, kind="loss")]  # two inspections that find a fault
    trainer = build_trainer("sft", model, out, preset="guarded", faults=faults, bf16=False, **config)
    trainer.train()
    assert trainer.state.global_step == 10
    return {name: p.detach().clone() for name, p in trainer.model.state_dict().items()}


def test_the_diagnosis_forward_draws_nothing_from_the_random_generators(tmp_path):
    """With dropout, a diagnosis forward that drew from the generator would train the steps after it on other masks:
    the run with bundles (a diagnosis at steps 3 and 7) ends on the same weights, bit for bit, as the run without
    (one diagnosis, at step 3)."""
    model = save_toy_model(str(tmp_path / "model"), "qwen2", attention_dropout=0.3)
    with_bundles = _final_weights(model, str(tmp_path / "bundles"))
    without = _final_weights(model, str(tmp_path / "none"), nan_replay_max_bytes=0)
    assert with_bundles.keys() == without.keys()
    differ = [name for name in with_bundles if not torch.equal(with_bundles[name], without[name])]
    assert differ == []
