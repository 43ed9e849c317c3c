"""The rule registry (ids, order, documentation, selection by trainer kind) and the engine's modes: `fix` applies
every fix in a new config, `warn` changes nothing, `strict` raises one error listing every finding, disabled rules
are reported as such.

Pure: every rule runs on a constructed `TrainerSetup`; nothing loads weights or trains.
"""

from __future__ import annotations

import math

import pytest
from peft import LoraConfig

import safe_trainers
from safe_trainers import DPOConfig, SafetyError
from safe_trainers.kinds import TRAINER_KINDS
from safe_trainers.rules import DEFAULT_RULES, get_rule, rule_ids
from safe_trainers.rules.apply import apply_to_setup
from safe_trainers.rules.engine import new_report, run_stage, select_rules, skipped_findings
from safe_trainers.rules.report import Change
from safe_trainers.testing.toy import model_config

from rule_utils import (  # tests/ is on sys.path, as for conftest
    EXPECTED_IDS, kto_data, make_args, make_setup, run_setup_stage, settings,
)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------------------


def test_rule_ids_are_stable_and_in_order():
    assert rule_ids() == EXPECTED_IDS
    assert len(set(rule_ids())) == len(rule_ids())


@pytest.mark.parametrize("rule", DEFAULT_RULES, ids=lambda r: r.id)
def test_every_rule_is_documented(rule):
    assert rule.summary.strip()
    assert rule.rationale.startswith("https://")
    assert rule.trainers and rule.trainers <= set(TRAINER_KINDS)
    assert get_rule(rule.id) is rule


def test_get_rule_unknown_lists_valid_ids():
    with pytest.raises(KeyError, match="Valid ids are: peft.reward_seq_cls_lora"):
        get_rule("nope")


@pytest.mark.parametrize(
    "kind, present, absent",
    [
        (
            "dpo",
            {"dpo.beta_positive", "data.no_loss_tokens"},
            {"grpo.group_size", "kto.batch_and_labels", "peft.reward_seq_cls_lora"},
        ),
        ("kto", {"kto.batch_and_labels", "dpo.beta_positive"}, {"grpo.group_size", "peft.reward_seq_cls_lora"}),
        ("reward", {"peft.reward_seq_cls_lora", "data.no_loss_tokens"}, {"grpo.group_size", "dpo.beta_positive"}),
        ("grpo", {"grpo.group_size"}, {"data.no_loss_tokens", "dpo.beta_positive", "kto.batch_and_labels"}),
        ("rloo", {"grpo.group_size"}, {"data.no_loss_tokens", "dpo.beta_positive", "kto.batch_and_labels"}),
        ("sft", {"data.no_loss_tokens", "optim.grad_clip"}, {"grpo.group_size", "dpo.beta_positive"}),
    ],
)
def test_select_rules_by_trainer_kind(kind, present, absent):
    enabled, disabled = select_rules(kind, settings())
    ids = {r.id for r in enabled}
    assert present <= ids and not (absent & ids)
    assert disabled == []
    common = {"precision.bf16_over_fp16", "optim.grad_clip", "logging.show_nonfinite", "attention.gemma2_no_flash"}
    assert common <= ids


def test_select_rules_splits_disabled_and_skipped_findings():
    enabled, disabled = select_rules("dpo", settings(disable=["optim.grad_clip", "grpo.group_size"]))
    assert "optim.grad_clip" not in {r.id for r in enabled}
    # grpo.group_size does not apply to DPO, so it is neither run nor reported as skipped there
    assert [r.id for r in disabled] == ["optim.grad_clip"]
    skipped = skipped_findings(disabled)
    assert [(f.rule_id, f.action) for f in skipped] == [("optim.grad_clip", "skipped")]
    assert "safety_disable_rules" in skipped[0].message


# --------------------------------------------------------------------------------------------------------------------
# Engine: modes
# --------------------------------------------------------------------------------------------------------------------


def _unsafe_gemma_setup():
    args = make_args(
        "dpo", fp16=True, max_grad_norm=0.0, model_init_kwargs={"attn_implementation": "flash_attention_2"}
    )
    return make_setup("dpo", "gemma2", args=args), args


def test_engine_fix_mode_applies_every_fix_in_a_new_config():
    setup, args = _unsafe_gemma_setup()
    new, report = run_setup_stage(setup)
    assert [(f.rule_id, f.action) for f in report.findings] == [
        ("precision.bf16_over_fp16", "fixed"),
        ("attention.gemma2_no_flash", "fixed"),
        ("optim.grad_clip", "fixed"),
        ("logging.show_nonfinite", "fixed"),
    ]
    a = new.args
    assert (a.fp16, a.bf16, a.max_grad_norm, a.logging_nan_inf_filter) == (False, True, 1.0, False)
    assert a.model_init_kwargs == {"attn_implementation": "eager"}
    assert type(a) is DPOConfig and a is not args
    # the user's config object is never mutated
    assert (args.fp16, args.bf16, args.max_grad_norm, args.logging_nan_inf_filter) == (True, False, 0.0, True)
    assert args.model_init_kwargs == {"attn_implementation": "flash_attention_2"}
    assert len(report.changes) == sum(len(f.changes) for f in report.findings)


def test_engine_warn_mode_changes_nothing():
    setup, args = _unsafe_gemma_setup()
    new, report = run_setup_stage(setup, mode="warn")
    assert new is setup and new.args is args
    assert {f.action for f in report.findings} == {"warned"}
    assert len(report.findings) == 4
    assert report.changes == []
    assert args.fp16 is True and args.max_grad_norm == 0.0


def test_engine_strict_mode_raises_one_error_listing_every_finding():
    setup, args = _unsafe_gemma_setup()
    with pytest.raises(SafetyError, match=r"refused this configuration \(3 problems\)") as exc:
        run_setup_stage(setup, mode="strict")
    err = exc.value
    # TRL's default `logging_nan_inf_filter=True` is changed, but it is not a problem of this config (issue 12).
    assert [f.rule_id for f in err.findings] == [
        "precision.bf16_over_fp16",
        "attention.gemma2_no_flash",
        "optim.grad_clip",
    ]
    assert all(f.action == "blocked" for f in err.findings)
    message = str(err)
    for f in err.findings:
        assert f"[{f.rule_id}]" in message
    assert "safety_disable_rules" in message and 'safety_mode="off"' in message
    assert args.fp16 is True  # nothing applied


def test_engine_strict_mode_blocks_plain_warnings_too():
    setup = make_setup("dpo", "llama", args=make_args("dpo", max_grad_norm=50.0, logging_nan_inf_filter=False))
    with pytest.raises(SafetyError, match=r"\(1 problem\):\n  \[optim.grad_clip\] `max_grad_norm=50.0`"):
        run_setup_stage(setup, mode="strict")


def test_engine_strict_mode_passes_a_clean_setup():
    setup = make_setup("dpo", "llama", args=make_args("dpo", logging_nan_inf_filter=False))
    new, report = run_setup_stage(setup, mode="strict")
    assert new is setup and report.findings == []
    assert report.render() == "safe_trainers (dpo): all safety rules passed, nothing changed."


def test_engine_blocked_findings_raise_before_any_fix():
    args = make_args("kto", per_device_train_batch_size=1, beta=math.nan, max_grad_norm=0.0)
    setup = make_setup("kto", "qwen2", args=args, train_dataset=kto_data([True, True]))
    s = settings()
    enabled, _ = select_rules("kto", s)
    report = new_report("kto", s)
    with pytest.raises(SafetyError, match=r"\(2 problems\)") as exc:
        run_stage(setup, enabled, s.safety_mode, report, check=lambda r, t: r.check(t), apply=apply_to_setup)
    assert [f.rule_id for f in exc.value.findings] == ["kto.batch_and_labels", "dpo.beta_positive"]
    assert "optim.grad_clip" not in str(exc.value)
    # Blocked findings raise before any fix is applied: nothing was changed or recorded as fixed.
    assert report.by_rule("optim.grad_clip") == []
    assert setup.args.max_grad_norm == 0.0


def test_engine_later_rules_see_earlier_fixes():
    seen = []

    class Recorder(safe_trainers.Rule):
        id = "test.recorder"
        summary = "records what it sees"

        def check(self, setup):
            seen.append(setup.args.max_grad_norm)
            return None

    setup = make_setup("dpo", "llama", args=make_args("dpo", max_grad_norm=0.0))
    rules = (get_rule("optim.grad_clip"), Recorder())
    run_setup_stage(setup, mode="fix", rules=rules)
    run_setup_stage(setup, mode="warn", rules=rules)
    # fix: a first pass on the setup as given (for blocked findings), then the applying pass sees the fix;
    # warn: the first pass only.
    assert seen == [0.0, 1.0, 0.0]


def test_disabled_rules_are_skipped_and_reported():
    args = make_args("dpo", max_grad_norm=0.0)
    new, report = run_setup_stage(make_setup("dpo", "llama", args=args), disable=["optim.grad_clip"])
    assert new.args.max_grad_norm == 0.0
    assert new.args.logging_nan_inf_filter is False
    assert [(f.rule_id, f.action) for f in report.findings] == [
        ("optim.grad_clip", "skipped"),
        ("logging.show_nonfinite", "fixed"),
    ]
    assert "[skipped] optim.grad_clip" in report.render()
    assert report.changes == [Change("args.logging_nan_inf_filter", True, False)]


def test_warn_mode_shows_what_each_rule_would_do():
    peft_config = LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"])
    args = make_args("reward", model_init_kwargs={"dtype": "float16"})
    setup = make_setup("reward", "qwen2", config=model_config("qwen2", dtype="float32"), args=args, peft_config=peft_config)
    new, report = run_setup_stage(setup, mode="warn")
    assert new.args is args and new.peft_config is peft_config
    # nothing was applied, so the precision rule still sees the fp16 load dtype
    assert [(f.rule_id, f.action) for f in report.findings] == [
        ("peft.reward_seq_cls_lora", "warned"),
        ("precision.bf16_over_fp16", "warned"),
        ("logging.show_nonfinite", "warned"),
    ]
    assert all('(not applied: `safety_mode="warn"`)' in f.message for f in report.findings)
    assert report.changes == []  # warned findings keep their changes for the record, but none counts as applied
