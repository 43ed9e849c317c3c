"""Small checkpoints written straight to disk, with no trainer: a `trainer_state.json`, a one-tensor
`model.safetensors` and, optionally, an `optimizer.pt`, as `transformers.Trainer` lays them out."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from transformers import TrainerState
from transformers.trainer import TRAINER_STATE_NAME


def write_checkpoint(
    run_dir: str,
    step: int,
    weight: float = 1.0,
    optimizer: float | None = None,
    state: bool = True,
    **best: object,
) -> str:
    """Write `run_dir/checkpoint-<step>` and return its path.

    Args:
        weight (`float`): the value of the model's one weight (NaN for a non-finite checkpoint).
        optimizer (`float`, *optional*): write an `optimizer.pt` whose one moment holds this value.
        state (`bool`): write `trainer_state.json` (a save that did not finish has none).
        **best: the best-model fields of its `trainer_state.json` (`best_metric=...`).
    """
    path = os.path.join(run_dir, f"checkpoint-{step}")
    os.makedirs(path, exist_ok=True)
    save_file({"w": torch.full((2, 2), weight)}, os.path.join(path, "model.safetensors"))
    if optimizer is not None:
        moments = {"state": {0: {"exp_avg": torch.full((2, 2), optimizer)}}, "param_groups": [{"params": [0]}]}
        torch.save(moments, os.path.join(path, "optimizer.pt"))
    if state:
        TrainerState(global_step=step, **best).save_to_json(os.path.join(path, TRAINER_STATE_NAME))
    return path
