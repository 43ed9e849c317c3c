"""The safety settings on every config (`safety_mode`, `safety_disable_rules`, ...) and the errors the package
raises."""

from __future__ import annotations

import pytest
import trl

from safe_trainers import (
    DPOConfig, GRPOConfig, KTOConfig, RewardConfig, SafetyArguments, SafetyError, TrainingDivergedError,
)  # fmt: skip
from safe_trainers.kinds import TRAINER_KINDS
from safe_trainers.rules.engine import select_rules
from safe_trainers.rules.report import Finding

from rule_utils import EXPECTED_IDS, OUT, make_args  # tests/ is on sys.path, as for conftest


# --------------------------------------------------------------------------------------------------------------------
# Safety settings
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config_class", [RewardConfig, DPOConfig, KTOConfig, GRPOConfig])
def test_unknown_rule_id_in_config_lists_valid_ids(config_class):
    extra = dict(num_generations=2, per_device_train_batch_size=2) if config_class is GRPOConfig else {}
    with pytest.raises(ValueError, match=r"unknown rule ids \['nope'\]\. Valid ids are: ") as exc:
        config_class(output_dir=OUT, use_cpu=True, safety_disable_rules=["nope", "optim.grad_clip"], **extra)
    for rule_id in EXPECTED_IDS:
        assert rule_id in str(exc.value)


def test_unknown_rule_id_from_config_object():
    class Launcher:
        safety_disable_rules = ["precision.bf16_over_fp16", "nope", "also.nope"]

    with pytest.raises(
        ValueError,
        match=r"unknown rule ids \['also.nope', 'nope'\]\. Valid ids are: .*precision.fp32_trainable_params",
    ):  # read from a config that is not a safe config, the ids are checked where the rules are chosen
        select_rules("dpo", SafetyArguments.from_config(Launcher()))


def test_from_config_defaults_for_plain_trl_config():
    s = SafetyArguments.from_config(trl.DPOConfig(output_dir=OUT, use_cpu=True))
    assert isinstance(s, SafetyArguments)
    assert (s.safety_mode, s.safety_disable_rules, s.nan_guard, s.nan_snapshot_steps) == ("fix", [], True, None)
    assert s.nan_snapshot_budget == 0.01  # the snapshot interval adapts to 1% of the wall time
    # each call gets its own list
    s.safety_disable_rules.append("optim.grad_clip")
    assert SafetyArguments.from_config(object()).safety_disable_rules == []


def test_from_config_reads_safety_fields_and_splits_strings():
    class Launcher:
        safety_mode = "strict"
        safety_disable_rules = "optim.grad_clip, logging.show_nonfinite"
        nan_guard = False

    s = SafetyArguments.from_config(Launcher())
    assert s.safety_mode == "strict" and s.nan_guard is False
    assert s.safety_disable_rules == ["optim.grad_clip", "logging.show_nonfinite"]
    assert DPOConfig(output_dir=OUT, use_cpu=True, safety_disable_rules="optim.grad_clip").safety_disable_rules == [
        "optim.grad_clip"
    ]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("safety_mode", "loud", r"`safety_mode` must be one of \['fix', 'warn', 'strict', 'off'\], got 'loud'"),
        ("nan_snapshot_steps", 0, r"`nan_snapshot_steps` must be an integer >= 1, got 0"),
        ("nan_snapshot_budget", -0.1, r"`nan_snapshot_budget` must be a fraction in \[0, 1\) \(0: a fixed interval"),
        ("nan_snapshot_budget", 1.0, r"`nan_snapshot_budget` must be a fraction in \[0, 1\)"),
        ("nan_snapshot_budget", float("nan"), r"`nan_snapshot_budget` must be a fraction in \[0, 1\)"),
        ("nan_max_rollbacks", -1, r"`nan_max_rollbacks` must be an integer >= 0"),
        ("nan_max_consecutive_skips", 0, r"`nan_max_consecutive_skips` must be an integer >= 1"),
        ("nan_lr_backoff", 0.0, r"`nan_lr_backoff` must be in \(0, 1\], got 0.0"),
        ("nan_lr_backoff", 1.5, r"`nan_lr_backoff` must be in \(0, 1\]"),
        ("nan_spike_factor", 0.5, r"`nan_spike_factor` must be 0 \(off\) or > 1"),
        ("nan_spike_window", 1, r"`nan_spike_window` must be an integer >= 2, got 1"),
        ("nan_spike_warmup", 65, r"`nan_spike_warmup` must be an integer from 2 to `nan_spike_window` \(64\)"),
    ],
)
def test_invalid_safety_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        DPOConfig(output_dir=OUT, use_cpu=True, **{field: value})
    with pytest.raises(ValueError, match=match):
        SafetyArguments(**{field: value})


def test_safety_fields_defaults_on_every_config():
    for kind in TRAINER_KINDS:
        args = make_args(kind)
        assert isinstance(args, SafetyArguments)
        assert (args.safety_mode, args.safety_disable_rules, args.nan_guard) == ("fix", [], True)


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


def test_safety_error_is_a_value_error():
    findings = [Finding("a.rule", "blocked", "first problem"), Finding("b.rule", "blocked", "second problem")]
    err = SafetyError(findings)
    assert isinstance(err, ValueError)
    assert err.findings == tuple(findings)
    lines = str(err).splitlines()
    assert lines[0] == "safe_trainers refused this configuration (2 problems):"
    assert lines[1:3] == ["  [a.rule] first problem", "  [b.rule] second problem"]
    assert "safety_disable_rules" in lines[3]
    assert str(SafetyError(findings[:1])).startswith("safe_trainers refused this configuration (1 problem):")
    assert str(SafetyError(findings[:1], header="custom header")).startswith("custom header\n  [a.rule] first problem")
    with pytest.raises(ValueError, match="first problem"):
        raise err


def test_training_diverged_error_is_a_runtime_error():
    err = TrainingDivergedError("diverged", checkpoint_dir="ckpt", report_path="events.jsonl")
    assert isinstance(err, RuntimeError) and not isinstance(err, ValueError)
    assert (str(err), err.checkpoint_dir, err.report_path) == ("diverged", "ckpt", "events.jsonl")


def test_nan_spike_patience_is_deprecated():
    with pytest.warns(FutureWarning, match=r"`nan_spike_patience` is deprecated and has no effect \(got 2\)"):
        SafetyArguments(nan_spike_patience=2)
