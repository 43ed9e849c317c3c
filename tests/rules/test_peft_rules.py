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
