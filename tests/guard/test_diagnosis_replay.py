"""The diagnosis replay (`trainer/replay.py::diagnose`) is not training: it leaves the trainer as it found it.

It replays a faulty step's micro-batches through `trainer.compute_loss` to name the first non-finite module. TRL's
`compute_loss` also counts metrics and tokens and, for GRPO with `use_adaptive_entropy=True` (TRL 1.8 and later),
steps the entropy controller (`entropy_coef`, `_last_world_entropy`, `_entropy_window_stats`): all of it must be put
back, or a diagnosis would change the logs, and for GRPO the loss of the next steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
import torch

from safe_trainers.trainer.replay import diagnose
from safe_trainers.testing.build import build_trainer


RUNS = {
    "sft": {},
    "reward": {},
    "dpo": {},
    "kto": {},
    "rloo": {},
    "grpo": {},
    # Starts between its bounds, so the controller's step would move it either way.
    "grpo-adaptive-entropy": dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=0.5),
}


def plain(value, depth=0):
    """A comparable copy of plain data (numbers, strings, tensors and containers of them); `None` for anything else.
    NaN compares equal to NaN here."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if torch.is_tensor(value):
        return ("tensor", plain(value.detach().float().cpu().tolist())) if value.numel() <= 4096 else None
    if depth < 4 and isinstance(value, Mapping):
        items = {str(k): plain(v, depth + 1) for k, v in value.items()}
        return None if any(v is None and value[k] is not None for k, v in zip(value, items.values())) else items
    if depth < 4 and isinstance(value, (list, tuple)) or type(value).__name__ == "deque":
        items = [plain(v, depth + 1) for v in value]
        return None if any(v is None and o is not None for v, o in zip(items, value)) else items
    return None


def plain_state(trainer) -> dict:
    """The trainer's attributes that hold plain data, by name."""
    state = {name: plain(value) for name, value in vars(trainer).items()}
    return {name: value for name, value in state.items() if value is not None or getattr(trainer, name) is None}


@pytest.mark.parametrize("run", list(RUNS))
def test_the_replay_leaves_the_trainer_as_it_was(toy_models, tmp_path, run):
    kind = run.split("-")[0]
    model = toy_models["qwen2-rm" if kind == "reward" else "qwen2"]
    trainer = build_trainer(kind, model, tmp_path, preset="guarded", max_steps=1, save_strategy="no", **RUNS[run])
    trainer.train()  # a real step: the optimizer, the accelerator and TRL's counters are set up as in training
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    before = plain_state(trainer)
    diagnose(trainer, [inputs], step=1)
    after = plain_state(trainer)
    assert {k: after.get(k) for k in before if after.get(k) != before[k]} == {}
