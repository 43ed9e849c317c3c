"""`attention.gemma2_no_flash`: soft-capped models (Gemma-2, soft-capped Gemma-3) never run sdpa or a flash-attn that
does not soft-cap in the backward pass; on model paths, instances and the reference model."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from rule_utils import change_map, make_args, make_setup  # tests/ is on sys.path, as for conftest

from safe_trainers.rules import get_rule
from safe_trainers.rules.apply import apply_to_setup
from safe_trainers.rules.attention import is_flash
from safe_trainers.rules.context import TrainerSetup
from safe_trainers.rules.hardware import Hardware
from safe_trainers.testing.toy import build_model, model_config
from transformers import AutoModelForCausalLM
from trainer_utils import (  # tests/ is on sys.path, as for conftest
    actions, check_gemma2_sdpa_without_the_rule, train_losses,
)
from safe_trainers.testing.build import build_trainer
import math

ATTENTION = get_rule("attention.gemma2_no_flash")


# --------------------------------------------------------------------------------------------------------------------
# attention.gemma2_no_flash
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, requested, expected_new",
    [
        ("gemma2", "sdpa", "eager"),
        ("gemma2", "flash_attention_2", "eager"),
        ("gemma2", "flash_attention_3", "eager"),
        ("gemma2", "kernels-community/flash-attn", "eager"),
        ("gemma2", "eager", None),
        ("gemma2", None, None),
        ("qwen2", "sdpa", None),
        ("llama", "flash_attention_2", None),
        ("gemma3", "sdpa", None),  # no soft-capping in the toy Gemma-3 config
    ],
)
def test_attention_rule_on_paths(family, requested, expected_new):
    mik = {} if requested is None else {"attn_implementation": requested}
    setup = make_setup("dpo", family, args=make_args("dpo", model_init_kwargs=mik))
    finding = ATTENTION.check(setup)
    if expected_new is None:
        assert finding is None
        return
    assert finding.action == "fixed"
    assert change_map(finding) == {"args.model_init_kwargs.attn_implementation": (requested, expected_new)}
    assert "attn_logit_softcapping=50.0" in finding.message
    assert ("backward pass" in finding.message) == is_flash(requested)


def test_attention_rule_softcapped_gemma3_config():
    cfg = model_config("gemma3", attn_logit_softcapping=30.0)
    setup = TrainerSetup(
        kind="dpo",
        args=make_args("dpo", model_init_kwargs={"attn_implementation": "flash_attention_2"}),
        model="toy/gemma3",
        model_config=cfg,
    )
    finding = ATTENTION.check(setup)
    assert finding is not None
    new = change_map(finding)["args.model_init_kwargs.attn_implementation"][1]
    assert new == "eager"


@pytest.fixture(scope="module")
def gemma2_instance():
    return build_model("gemma2")


@pytest.mark.parametrize("current", ["flash_attention_2", "sdpa"])
def test_attention_rule_on_instances_and_ref_model(gemma2_instance, current):
    model = gemma2_instance
    ref = copy.deepcopy(model)
    model.config._attn_implementation = current
    ref.config._attn_implementation = current
    setup = make_setup("dpo", "gemma2", model=model, ref_model=ref)
    finding = ATTENTION.check(setup)
    assert change_map(finding) == {
        "model.attn_implementation": (current, "eager"),
        "ref_model.attn_implementation": (current, "eager"),
    }
    new = apply_to_setup(setup, finding)
    assert new.model is model and model.config._attn_implementation == "eager"
    assert ref.config._attn_implementation == "eager"
    assert ATTENTION.check(new) is None


def test_attention_rule_leaves_eager_instance_alone(gemma2_instance):
    gemma2_instance.config._attn_implementation = "eager"
    assert ATTENTION.check(make_setup("dpo", "gemma2", model=gemma2_instance)) is None


def test_gemma2_flash_kept_with_a_flash_attn_that_soft_caps():
    # flash-attn 2.6.3 and later soft-cap in the backward pass too: a valid run, not rewritten to eager.
    rule = ATTENTION
    args = make_args("dpo", model_init_kwargs={"attn_implementation": "flash_attention_2"})
    new = dataclasses.replace(Hardware(), flash_attn_version="2.7.4.post1")
    old = dataclasses.replace(Hardware(), flash_attn_version="2.5.9")
    assert rule.check(make_setup("dpo", "gemma2", args=args, hardware=new)) is None
    finding = rule.check(make_setup("dpo", "gemma2", args=args, hardware=old))
    assert finding.action == "fixed" and "2.5.9" in finding.message


# --------------------------------------------------------------------------------------------------------------------
# On a real safe trainer, built (and where the claim needs it, trained) from a tiny model
# --------------------------------------------------------------------------------------------------------------------


def test_gemma2_path_with_sdpa_trains_with_eager(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["gemma2"], tmp_path, model_init_kwargs={"attn_implementation": "sdpa"})
    assert trainer.model.config._attn_implementation == "eager"
    assert trainer.args.model_init_kwargs == {"attn_implementation": "eager"}
    (finding,) = trainer.safety_report.by_rule("attention.gemma2_no_flash")
    assert finding.action == "fixed"
    assert [(c.path, c.old, c.new) for c in finding.changes] == [
        ("args.model_init_kwargs.attn_implementation", "sdpa", "eager")
    ]
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_gemma2_path_with_sdpa_without_the_rule(toy_models, tmp_path):
    check_gemma2_sdpa_without_the_rule("dpo", toy_models["gemma2"], tmp_path)


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
@pytest.mark.parametrize("current", ["sdpa", "flash_attention_2"])
def test_gemma2_instance_attention_replaced(kind, current, toy_models, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(toy_models["gemma2"])
    model.config._attn_implementation = current  # flash-attn is not installed: set what a loaded model would carry
    trainer = build_trainer(kind, model, tmp_path, rows=4)
    assert trainer.model.config._attn_implementation == "eager"
    (finding,) = trainer.safety_report.by_rule("attention.gemma2_no_flash")
    assert [(c.path, c.old, c.new) for c in finding.changes] == [("model.attn_implementation", current, "eager")]
    if kind == "dpo" and current == "flash_attention_2":
        assert "backward pass" in finding.message
        assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_gemma2_ref_model_attention_replaced(toy_models, tmp_path):
    ref = AutoModelForCausalLM.from_pretrained(toy_models["gemma2"])
    ref.config._attn_implementation = "flash_attention_2"
    trainer = build_trainer("dpo", toy_models["gemma2"], tmp_path, rows=4, trainer_kwargs={"ref_model": ref})
    assert ref.config._attn_implementation == "eager"
    (finding,) = trainer.safety_report.by_rule("attention.gemma2_no_flash")
    assert [c.path for c in finding.changes] == ["ref_model.attn_implementation"]


@pytest.mark.parametrize("as_instance", [False, True], ids=["path", "instance"])
def test_qwen2_sdpa_not_touched(as_instance, toy_models, tmp_path):
    if as_instance:
        model = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"], attn_implementation="sdpa")
        trainer = build_trainer("dpo", model, tmp_path, rows=4)
    else:
        trainer = build_trainer(
            "dpo", toy_models["qwen2"], tmp_path, rows=4, model_init_kwargs={"attn_implementation": "sdpa"}
        )
        assert trainer.args.model_init_kwargs == {"attn_implementation": "sdpa"}
    assert trainer.model.config._attn_implementation == "sdpa"
    assert "attention.gemma2_no_flash" not in actions(trainer)
