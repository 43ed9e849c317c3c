"""How findings' changes are applied: to a copy of the config (never the user's), to the DeepSpeed dict (precision
and clipping), to the derived fields of a GRPO config; and the read-only `TrainerSetup` the rules inspect."""

from __future__ import annotations

import copy
from dataclasses import FrozenInstanceError

import pytest
import trl

from safe_trainers.rules import get_rule
from safe_trainers.rules.apply import apply_to_setup, replace_args
from safe_trainers.rules.context import TrainerSetup, read_model_config
from safe_trainers.rules.engine import select_rules
from safe_trainers.rules.hardware import Hardware
from safe_trainers.rules.report import Change, Finding, REMOVED
from safe_trainers.testing.toy import build_model, model_config

from rule_utils import (  # tests/ is on sys.path, as for conftest
    CPU, CUDA_NO_BF16, OUT, change_map, make_args, make_setup, run_setup_stage, settings,
)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# DeepSpeed dict changes (precision + clipping)
# --------------------------------------------------------------------------------------------------------------------


def deepspeed_dict(**overrides):
    ds = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto"}
    ds.update(overrides)
    return ds


def test_deepspeed_fp16_and_clipping_fixed_in_a_copy():
    user_ds = deepspeed_dict(fp16={"enabled": True}, gradient_clipping=0.0)
    original = copy.deepcopy(user_ds)
    args = make_args("dpo", deepspeed=user_ds)
    setup = make_setup("dpo", "llama", args=args, deepspeed_config=user_ds)
    new, report = run_setup_stage(setup, disable=["logging.show_nonfinite"])
    assert new.deepspeed_config["fp16"]["enabled"] is False
    assert new.deepspeed_config["bf16"]["enabled"] is True
    assert new.deepspeed_config["gradient_clipping"] == 1.0
    assert new.args.deepspeed == new.deepspeed_config
    # neither the user's dict nor the user's config changed
    assert user_ds == original and args.deepspeed == original
    prec = change_map(report.by_rule("precision.bf16_over_fp16")[0])
    assert prec["args.deepspeed.fp16.enabled"] == (True, False)
    assert prec["args.deepspeed.bf16.enabled"][0] is REMOVED
    clip = change_map(report.by_rule("optim.grad_clip")[0])
    assert clip == {"args.deepspeed.gradient_clipping": (0.0, 1.0)}


@pytest.mark.parametrize(
    "ds, max_grad_norm, expected",
    [
        (deepspeed_dict(gradient_clipping="auto"), 1.0, None),
        (deepspeed_dict(gradient_clipping=1.0), 1.0, None),
        (deepspeed_dict(gradient_clipping=0.5), 0.5, None),
        (deepspeed_dict(gradient_clipping=0.0), 1.0, {"args.deepspeed.gradient_clipping": (0.0, 1.0)}),
        (deepspeed_dict(gradient_clipping=2.0), 0.5, {"args.deepspeed.gradient_clipping": (2.0, 0.5)}),
        (deepspeed_dict(), 1.0, {"args.deepspeed.gradient_clipping": (REMOVED, 1.0)}),
        (
            deepspeed_dict(gradient_clipping=0.0),
            0.0,
            {"args.max_grad_norm": (0.0, 1.0), "args.deepspeed.gradient_clipping": (0.0, 1.0)},
        ),
    ],
)
def test_grad_clip_deepspeed_agreement(ds, max_grad_norm, expected):
    setup = make_setup("dpo", "llama", args=make_args("dpo", max_grad_norm=max_grad_norm), deepspeed_config=ds)
    finding = get_rule("optim.grad_clip").check(setup)
    if expected is None:
        assert finding is None
    else:
        assert finding.action == "fixed"
        assert change_map(finding) == expected


def test_replace_args_deepspeed_path_without_deepspeed_config_is_an_error():
    with pytest.raises(ValueError, match="`args.deepspeed` is not set"):
        replace_args(make_args("dpo"), [Change("args.deepspeed.gradient_clipping", 0.0, 1.0)], None)


@pytest.mark.parametrize(
    "setup_kw",
    [
        pytest.param(dict(family="gemma2", args_kw=dict(fp16=True), hardware=CPU), id="fp16-flag-bf16-hw"),
        pytest.param(
            dict(family="llama", args_kw=dict(), hardware=CPU, ds=deepspeed_dict(fp16={"enabled": True})),
            id="deepspeed-fp16-only",
        ),
        pytest.param(
            dict(family="gemma2", args_kw=dict(fp16=True), hardware=CUDA_NO_BF16),
            id="no-bf16-gemma",
        ),
        pytest.param(dict(family="llama", args_kw=dict(max_grad_norm=0.0), hardware=CPU), id="grad-clip"),
        pytest.param(
            dict(family="gemma2", args_kw=dict(model_init_kwargs={"attn_implementation": "sdpa"}), hardware=CPU),
            id="attention",
        ),
    ],
)
def test_every_recorded_change_changes_something(setup_kw):
    args = make_args("dpo", **setup_kw["args_kw"])
    setup = make_setup(
        "dpo", setup_kw["family"], hardware=setup_kw["hardware"], args=args, deepspeed_config=setup_kw.get("ds")
    )
    findings = [f for f in (r.check(setup) for r in select_rules("dpo", settings())[0]) if f is not None]
    changes = [c for f in findings for c in f.changes]
    assert changes
    noops = [c.render() for c in changes if c.old is not REMOVED and c.new is not REMOVED and c.old == c.new]
    assert noops == []


# --------------------------------------------------------------------------------------------------------------------
# apply_to_setup
# --------------------------------------------------------------------------------------------------------------------


def test_apply_to_setup_never_mutates_user_config():
    mik = {"dtype": "float16", "attn_implementation": "sdpa"}
    args = make_args("dpo", fp16=True, max_grad_norm=0.0, model_init_kwargs=mik)
    snapshot = dict(vars(args))
    setup = make_setup("dpo", "gemma2", args=args)
    for rule in select_rules("dpo", settings())[0]:
        finding = rule.check(setup)
        if finding is not None and finding.action == "fixed":
            setup = apply_to_setup(setup, finding)
    assert setup.args is not args
    assert setup.args.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "eager"}
    assert mik == {"dtype": "float16", "attn_implementation": "sdpa"}
    assert vars(args) == snapshot


def test_apply_to_setup_returns_same_setup_without_changes():
    setup = make_setup("dpo")
    assert apply_to_setup(setup, Finding("x", "fixed", "nothing")) is setup


def test_apply_to_setup_unknown_path_is_an_error():
    with pytest.raises(ValueError, match="No way to apply a change to `train_dataset.num_rows` before construction"):
        apply_to_setup(make_setup("dpo"), Finding("x", "fixed", "m", (Change("train_dataset.num_rows", 3, 2),)))


def test_apply_to_setup_keeps_plain_trl_config_class():
    args = trl.DPOConfig(output_dir=OUT, use_cpu=True, report_to="none", max_grad_norm=0.0)
    setup = TrainerSetup(kind="dpo", args=args, model="toy/llama", model_config=model_config("llama"))
    new, _ = run_setup_stage(setup)
    assert type(new.args) is trl.DPOConfig
    assert new.args.max_grad_norm == 1.0 and args.max_grad_norm == 0.0


def test_apply_to_setup_grpo_derived_fields():
    args = make_args(
        "grpo", per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=2, max_grad_norm=0.0
    )
    assert (args.generation_batch_size, args.steps_per_generation) == (8, 2)
    new, _ = run_setup_stage(make_setup("grpo", "qwen2", args=args))
    assert (new.args.generation_batch_size, new.args.steps_per_generation) == (8, 2)
    assert new.args.max_grad_norm == 1.0


def test_trainer_setup_is_read_only():
    setup = make_setup("dpo")
    with pytest.raises(FrozenInstanceError):
        setup.args = None
    with pytest.raises(FrozenInstanceError):
        CPU.bf16_supported = False


def test_trainer_setup_views():
    setup = make_setup("dpo", "gemma3", args=make_args("dpo", model_init_kwargs={"dtype": "auto"}))
    assert setup.model_is_path and setup.model_name == "toy/gemma3"
    assert setup.model_types == {"gemma3_text"}
    kwargs = setup.model_init_kwargs
    kwargs["dtype"] = "float16"
    assert setup.args.model_init_kwargs == {"dtype": "auto"}  # a copy
    inst = make_setup("dpo", "gemma2", model=build_model("gemma2"))
    assert not inst.model_is_path and inst.model_types == {"gemma2"}
    assert TrainerSetup(kind="dpo", args=make_args("dpo")).model_types == set()
    assert Hardware() == CPU
    assert Hardware.detect().accelerator in ("cpu", "cuda", "xpu", "mps")


def test_read_model_config(toy_models, tmp_path):
    cfg = read_model_config(toy_models["gemma2"])
    assert cfg.model_type == "gemma2" and cfg.attn_logit_softcapping == 50.0
    assert read_model_config(str(tmp_path / "missing")) is None
    assert read_model_config(None) is None
