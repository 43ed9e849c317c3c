"""Helpers shared by the training tests: build a safe trainer on a tiny saved model, train it, read its report."""

from __future__ import annotations

import json
import os

import torch

from safe_trainers.testing.quick import quick_args
from safe_trainers.configs import config_class
from safe_trainers.kinds import KINDS
from safe_trainers.testing.toy import dataset_for
from safe_trainers.trainers import trainer_class


CONFIGS = {kind: config_class(kind) for kind in KINDS}
TRAINERS = {kind: trainer_class(kind) for kind in KINDS}

DEFAULT_MODEL = {k.id: "qwen2-rm" if k.model_task == "seq_cls" else "qwen2" for k in KINDS.values()}


def rank_reward(completions, **kwargs) -> list[float]:
    """A GRPO reward that always differs inside a group, so every step has non-zero advantages."""
    return [float(i % 4) for i in range(len(completions))]


def config_kwargs(kind: str, tmp_path, **overrides) -> dict:
    # `learning_rate=1e-5`: the highest full fine-tuning rate `optim.learning_rate` accepts without a warning
    kwargs = quick_args(output_dir=str(tmp_path / f"{kind}-out"), learning_rate=1e-5)
    if KINDS[kind].online:
        kwargs.update(num_generations=2, max_completion_length=8)
    kwargs.update(overrides)
    return kwargs


def build(kind: str, model, tmp_path, *, dataset=None, n=8, config_class=None, **overrides):
    """A safe trainer of `kind`; `overrides` go to the config, except trainer keywords given as `trainer_*`."""
    trainer_kwargs = {
        k.removeprefix("trainer_"): overrides.pop(k) for k in list(overrides) if k.startswith("trainer_")
    }
    args = (config_class or CONFIGS[kind])(**config_kwargs(kind, tmp_path, **overrides))
    if KINDS[kind].online:
        trainer_kwargs.setdefault("reward_funcs", rank_reward)
    data = dataset if dataset is not None else dataset_for(kind, n)
    return TRAINERS[kind](model=model, args=args, train_dataset=data, **trainer_kwargs)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def changed(before: dict[str, torch.Tensor], model) -> list[str]:
    return [name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())]


def train_losses(trainer) -> list[float]:
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses, trainer.state.log_history
    return losses


def actions(trainer) -> dict[str, str]:
    return {f.rule_id: f.action for f in trainer.safety_report.findings}


def read_report(trainer) -> dict:
    with open(os.path.join(trainer.args.output_dir, "safety_report.json")) as f:
        return json.load(f)
