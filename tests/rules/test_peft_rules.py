"""`peft.reward_seq_cls_lora`: a reward model's LoRA must train and save its score head, before construction (the PEFT
config) and after (the built PEFT model)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, TaskType, get_peft_model

from safe_trainers.rules import BuiltTrainer, get_rule
from safe_trainers.rules.report import Change, REMOVED
from safe_trainers.testing.toy import build_model, model_config

from rule_utils import change_map, make_args, make_setup, run_setup_stage  # tests/ is on sys.path, as for conftest
from transformers import AutoModelForSequenceClassification
from trainer_utils import actions, changed, snapshot, train_losses  # tests/ is on sys.path, as for conftest
from safe_trainers.testing.build import build_trainer
import math
import os
from safetensors import safe_open


REWARD_LORA = get_rule("peft.reward_seq_cls_lora")


# --------------------------------------------------------------------------------------------------------------------
# peft.reward_seq_cls_lora
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task_type, mik, model_is_path, expected",
    [
        (None, {}, True, {"peft_config.task_type": (None, "SEQ_CLS")}),
        ("CAUSAL_LM", {}, True, {"peft_config.task_type": ("CAUSAL_LM", "SEQ_CLS")}),
        (TaskType.CAUSAL_LM, {}, True, {"peft_config.task_type": ("CAUSAL_LM", "SEQ_CLS")}),
        ("SEQ_CLS", {"dtype": "float16"}, True, {"args.model_init_kwargs.dtype": ("float16", "auto")}),
        (
            "SEQ_CLS",
            {"torch_dtype": torch.float16},
            True,
            {
                "args.model_init_kwargs.dtype": (REMOVED, "auto"),
                "args.model_init_kwargs.torch_dtype": (torch.float16, REMOVED),
            },
        ),
        (
            None,
            {"dtype": "float16"},
            True,
            {"peft_config.task_type": (None, "SEQ_CLS"), "args.model_init_kwargs.dtype": ("float16", "auto")},
        ),
        ("SEQ_CLS", {}, True, None),
        (TaskType.SEQ_CLS, {"dtype": "bfloat16"}, True, None),
        ("SEQ_CLS", {"dtype": "float16"}, False, None),  # an instance: the load dtype is not ours to change
    ],
)
def test_reward_lora_check(task_type, mik, model_is_path, expected):
    peft_config = LoraConfig(task_type=task_type, target_modules=["q_proj", "v_proj"])
    model = None if model_is_path else build_model("qwen2", "seq_cls")
    setup = make_setup(
        "reward",
        "qwen2",
        model=model,
        config=model_config("qwen2", dtype="float32"),  # a checkpoint stored in fp32: "auto" loads fp32
        args=make_args("reward", model_init_kwargs=mik),
        peft_config=peft_config,
    )
    finding = REWARD_LORA.check(setup)
    if expected is None:
        assert finding is None
        return
    assert finding.action == "fixed"
    got = change_map(finding)
    assert set(got) == set(expected)
    for path, (old, new) in expected.items():
        assert (got[path][0] is REMOVED) if old is REMOVED else got[path][0] == old
        assert (got[path][1] is REMOVED) if new is REMOVED else got[path][1] == new


@pytest.mark.parametrize("stored", ["float16", None])
def test_reward_lora_leaves_fp16_to_the_precision_rule_when_auto_could_load_fp16(stored):
    # `dtype="auto"` would load a checkpoint stored in fp16 in fp16 (or an unknown one maybe): the precision rule,
    # which runs next, turns the fp16 request into bf16 instead
    peft_config = LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"])
    args = make_args("reward", model_init_kwargs={"dtype": "float16"})
    config = model_config("gemma2", dtype=stored) if stored else model_config("gemma2")
    setup = make_setup("reward", "gemma2", config=config, args=args, peft_config=peft_config)
    assert REWARD_LORA.check(setup) is None
    new, report = run_setup_stage(setup)
    assert new.args.model_init_kwargs == {"dtype": "bfloat16"}
    assert [f.action for f in report.by_rule("precision.bf16_over_fp16")] == ["fixed"]


def test_reward_lora_without_peft_is_silent():
    setup = make_setup("reward", "qwen2", args=make_args("reward", model_init_kwargs={"dtype": "float16"}))
    assert REWARD_LORA.check(setup) is None


def test_reward_lora_fix_copies_the_peft_config_and_runs_before_precision():
    peft_config = LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"])
    args = make_args("reward", model_init_kwargs={"dtype": "float16"})
    config = model_config("qwen2", dtype="float32")
    setup = make_setup("reward", "qwen2", config=config, args=args, peft_config=peft_config)
    new, report = run_setup_stage(setup)
    assert new.peft_config is not peft_config and new.peft_config.task_type == "SEQ_CLS"
    assert peft_config.task_type == "CAUSAL_LM"  # the user's PEFT config is untouched
    assert new.peft_config.target_modules == peft_config.target_modules
    assert new.args.model_init_kwargs == {"dtype": "auto"} and args.model_init_kwargs == {"dtype": "float16"}
    # the LoRA rule picked `dtype="auto"` first, so the precision rule found nothing left to switch to bf16
    assert report.by_rule("precision.bf16_over_fp16") == []
    assert [f.rule_id for f in report.findings] == ["peft.reward_seq_cls_lora", "logging.show_nonfinite"]


def _seq_cls_lora(task_type="SEQ_CLS", dtype=torch.float32, **lora):
    model = build_model("qwen2", "seq_cls").to(dtype)
    config = LoraConfig(task_type=task_type, target_modules=["q_proj", "v_proj"], r=2, **lora)
    return get_peft_model(model, config, autocast_adapter_dtype=False), config


def test_reward_lora_check_built():
    model, config = _seq_cls_lora()
    assert REWARD_LORA.check_built(BuiltTrainer("reward", make_args("reward"), model, peft_config=config)) is None

    # a frozen head has a fix (train it and save it with the adapter): fixed, not refused
    frozen, config = _seq_cls_lora(task_type=None)
    finding = REWARD_LORA.check_built(BuiltTrainer("reward", make_args("reward"), frozen, peft_config=config))
    assert finding.action == "fixed" and "is frozen in the PEFT model" in finding.message
    assert finding.changes == (Change("model.peft_config.modules_to_save", None, ["score"]),)

    # no head this rule knows by name: it cannot check it, so it says so (a custom head may be trained)
    no_head = get_peft_model(build_model("qwen2"), LoraConfig(target_modules=["q_proj"], r=2))
    finding = REWARD_LORA.check_built(
        BuiltTrainer("reward", make_args("reward"), no_head, peft_config=no_head.peft_config["default"])
    )
    assert finding.action == "warned" and "no `score` or `classifier` head" in finding.message

    half, config = _seq_cls_lora(dtype=torch.float16)
    finding = REWARD_LORA.check_built(BuiltTrainer("reward", make_args("reward"), half, peft_config=config))
    assert finding.action == "fixed" and "fp16" in finding.message
    assert finding.changes == (Change("model.trainable_params.dtype", "float16", "float32"),)
    assert finding.data["names"] and all(n in dict(half.named_parameters()) for n in finding.data["names"])

    # without PEFT the rule has nothing to say
    assert (
        REWARD_LORA.check_built(BuiltTrainer("reward", make_args("reward"), build_model("qwen2", "seq_cls"))) is None
    )


# --------------------------------------------------------------------------------------------------------------------
# On a real safe trainer, built (and where the claim needs it, trained) from a tiny model
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_reward_lora_gets_seq_cls_trainable_head_and_saves_it(task_type, toy_models, tmp_path):
    peft_config = LoraConfig(task_type=task_type, target_modules=["q_proj", "v_proj"], r=4)
    trainer = build_trainer(
        "reward",
        toy_models["qwen2-rm"],
        tmp_path,
        model_init_kwargs={"dtype": "float16"},
        trainer_kwargs={"peft_config": peft_config},
    )
    assert trainer.model.peft_config["default"].task_type == "SEQ_CLS"
    assert peft_config.task_type == task_type  # the user's PEFT config is untouched
    head = {name: p.requires_grad for name, p in trainer.model.named_parameters() if "score" in name}
    assert any(head.values()), head
    fp16_trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    assert fp16_trainable == []
    assert trainer.args.model_init_kwargs == {"dtype": "auto"}
    (finding,) = trainer.safety_report.by_rule("peft.reward_seq_cls_lora")
    assert finding.action == "fixed" and f"`task_type={task_type!r}`" in finding.message
    # the LoRA rule chose dtype "auto" first, so the precision rule had nothing left to do
    assert "precision.bf16_over_fp16" not in actions(trainer)

    trained_head = [n for n, p in trainer.model.named_parameters() if "score" in n and p.requires_grad]
    before = snapshot(trainer.model)
    losses = train_losses(trainer)
    assert all(math.isfinite(loss) for loss in losses)
    assert set(trained_head) <= set(changed(before, trainer.model))

    trainer.save_model()
    with safe_open(os.path.join(trainer.args.output_dir, "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any("score" in key for key in keys), keys
    assert any("lora_A" in key for key in keys)


def test_reward_lora_head_stays_frozen_without_the_rule(toy_models, tmp_path):
    # the control: TRL alone leaves the random score head frozen with `task_type=None`
    trainer = build_trainer(
        "reward",
        toy_models["qwen2-rm"],
        tmp_path,
        rows=4,
        safety_disable_rules=["peft.reward_seq_cls_lora"],
        trainer_kwargs={"peft_config": LoraConfig(task_type=None, target_modules=["q_proj", "v_proj"], r=4)},
    )
    head = {name: p.requires_grad for name, p in trainer.model.named_parameters() if "score" in name}
    assert head and not any(head.values())
    assert actions(trainer)["peft.reward_seq_cls_lora"] == "skipped"


def test_reward_lora_seq_cls_fp32_not_touched(toy_models, tmp_path):
    trainer = build_trainer(
        "reward",
        toy_models["qwen2-rm"],
        tmp_path,
        rows=4,
        trainer_kwargs={"peft_config": LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"], r=4)},
    )
    assert "peft.reward_seq_cls_lora" not in actions(trainer)


def test_reward_lora_fp16_instance_head_upcast(toy_models, tmp_path):
    # with the precision rule off the fp16 weights stay; the reward rule still upcasts the trainable head
    model = AutoModelForSequenceClassification.from_pretrained(toy_models["qwen2-rm"], dtype=torch.float16)
    trainer = build_trainer(
        "reward",
        model,
        tmp_path,
        safety_disable_rules=["precision.bf16_over_fp16"],
        trainer_kwargs={"peft_config": LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"], r=4)},
    )
    (finding,) = trainer.safety_report.by_rule("peft.reward_seq_cls_lora")
    assert finding.action == "fixed" and "upcast to fp32" in finding.message
    assert any("score" in name for name in finding.data["names"])
    trainable = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and set(trainable.values()) == {torch.float32}
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_reward_peft_model_with_frozen_head_gets_a_trained_and_saved_head(toy_models, tmp_path):
    # TRL's own `test_train_peft_model`: a `PeftModel` made with a plain `LoraConfig()` (no task type), so the random
    # `score` head is frozen. It was refused; the fix is to train the head and save it with the adapter.
    model = AutoModelForSequenceClassification.from_pretrained(toy_models["qwen2-rm"])
    base_names = {f"base_model.model.{n}" for n, _ in model.named_parameters()}
    model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], r=4))
    trainer = build_trainer("reward", model, tmp_path, rows=4)
    (finding,) = trainer.safety_report.by_rule("peft.reward_seq_cls_lora")
    assert finding.action == "fixed" and "`score`" in finding.message
    assert [(c.path, c.old, c.new) for c in finding.changes] == [("model.peft_config.modules_to_save", None, ["score"])]
    head = {n: p.requires_grad for n, p in trainer.model.named_parameters() if "score" in n}
    assert any(head.values()), head

    before = snapshot(trainer.model)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))
    moved = set(changed(before, trainer.model))
    assert not moved & base_names  # the base model (its original head included) is untouched
    assert any("score.modules_to_save" in n for n in moved) and any("lora_B" in n for n in moved)
    trainer.save_model()
    with safe_open(os.path.join(trainer.args.output_dir, "adapter_model.safetensors"), "pt") as f:
        assert any("score" in key for key in f.keys())
