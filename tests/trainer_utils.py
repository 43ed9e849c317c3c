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


def check_gemma2_sdpa_without_the_rule(kind: str, model_path: str, tmp_path) -> None:
    """The control of `attention.gemma2_no_flash`: without the rule, transformers 5.21 and later refuse sdpa for
    Gemma-2; 5.3-5.20 accept it (`_supports_sdpa = True`) and load a model whose attention drops the soft-cap."""
    import pytest
    from transformers import Gemma2PreTrainedModel

    from safe_trainers.testing.build import build_trainer

    def build():
        return build_trainer(
            kind,
            model_path,
            tmp_path,
            model_init_kwargs={"attn_implementation": "sdpa"},
            safety_disable_rules=["attention.gemma2_no_flash"],
        )

    if Gemma2PreTrainedModel._supports_sdpa:
        assert build().model.config._attn_implementation == "sdpa"
        return
    with pytest.raises(ValueError, match="does not support an attention implementation"):
        build()
