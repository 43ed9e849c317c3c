"""Helpers shared by the training tests: the safe classes by kind, and what a trained trainer left (weights, losses,
findings, report). Trainers are built with `safe_trainers.testing.build.build_trainer`."""

from __future__ import annotations

import json
import os

import torch

from safe_trainers.configs import config_class
from safe_trainers.kinds import KINDS
from safe_trainers.trainers import trainer_class


CONFIGS = {kind: config_class(kind) for kind in KINDS}
TRAINERS = {kind: trainer_class(kind) for kind in KINDS}

DEFAULT_MODEL = {k.id: "qwen2-rm" if k.model_task == "seq_cls" else "qwen2" for k in KINDS.values()}


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
