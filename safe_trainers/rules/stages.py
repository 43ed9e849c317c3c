"""The trainers' two rule stages, one entry each, used by the safe trainers, `safe-trainers check` and the tests.

1. `run_setup_rules`: before any weight is loaded, on the [`TrainerSetup`]; fixes give a new setup (`apply_to_setup`).
2. `run_built_rules`: after TRL's constructor, on the built trainer ([`BuiltTrainer`] view); each fix is carried out
   in place by the rule that found it ([`Rule.apply_built`]).

The engine (`engine.py`) decides what is raised, reported and applied; these entries give it the actions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..arguments import SafetyArguments
from ..errors import SafetyError
from . import DEFAULT_RULES, BuiltTrainer, Rule
from .apply import apply_to_setup
from .context import TrainerSetup
from .engine import new_report, run_stage, select_rules
from .report import Finding, SafetyReport


def run_setup_rules(
    setup: TrainerSetup,
    settings: SafetyArguments,
    *,
    rules: Iterable[Rule] = DEFAULT_RULES,
    raise_blocked: bool = True,
) -> tuple[TrainerSetup, SafetyReport]:
    """Run the construction-time rules of `setup.kind` and return the (fixed) setup and the report.

    Args:
        setup ([`TrainerSetup`]): what the trainer is about to be built from.
        settings ([`SafetyArguments`]): `safety_mode` and `safety_disable_rules`.
        rules (`Iterable[Rule]`, *optional*): the rule set (default: every built-in rule).
        raise_blocked (`bool`, *optional*, defaults to `True`): raise [`SafetyError`] for blocked findings (and every
            finding in `"strict"` mode); `False` records them in the report instead (`safe-trainers check`).
    """
    enabled, disabled = select_rules(setup.kind, settings, rules)
    report = new_report(setup.kind, settings, disabled)
    report.notes += setup.assumptions
    if settings.safety_mode == "off":
        return setup, report
    try:
        setup = run_stage(setup, enabled, settings.safety_mode, report, check=_check_setup, apply=apply_to_setup)
    except SafetyError as error:
        if raise_blocked:
            raise
        report.findings.extend(error.findings)
    return setup, report


def run_built_rules(
    trainer: Any,
    settings: SafetyArguments,
    report: SafetyReport,
    source_rows: int | None = None,
    *,
    rules: Iterable[Rule] = DEFAULT_RULES,
) -> None:
    """Run the rules that need the loaded model or the tokenized data on a built safe trainer, recording them in
    `report`; each fix is applied to the trainer, in place, by its rule's `apply_built`. `source_rows`: the training
    set's size as passed, before TRL's preprocessing; `rules`: the rule set (default: every built-in rule)."""
    if settings.safety_mode == "off":
        return
    enabled, _ = select_rules(trainer._safety_kind, settings, rules)
    owners = {rule.id: rule for rule in enabled}

    def check(rule: Rule, target: Any) -> Any:
        return rule.check_built(built_view(target, source_rows))

    def apply(target: Any, finding: Finding) -> Any:
        owners[finding.rule_id].apply_built(target, finding)
        return target

    run_stage(trainer, enabled, settings.safety_mode, report, check=check, apply=apply)


def built_view(trainer: Any, source_rows: int | None = None) -> BuiltTrainer:
    """The read-only [`BuiltTrainer`] the built-stage rules inspect."""
    peft_config = getattr(getattr(trainer.model, "peft_config", None), "get", lambda _: None)("default")
    return BuiltTrainer(
        kind=trainer._safety_kind,
        args=trainer.args,
        model=trainer.model,
        train_dataset=trainer.train_dataset,
        source_rows=source_rows,
        processing_class=getattr(trainer, "processing_class", None),
        ref_model=getattr(trainer, "ref_model", None),
        peft_config=peft_config,
    )


def built_rule_ids(rules: Iterable[Rule] = DEFAULT_RULES) -> list[str]:
    """The rules with a check on the built trainer (they cannot run in `safe-trainers check`)."""
    return [rule.id for rule in rules if type(rule).check_built is not Rule.check_built]


def _check_setup(rule: Rule, setup: TrainerSetup) -> Any:
    return rule.check(setup)


__all__ = ["built_rule_ids", "built_view", "run_built_rules", "run_setup_rules"]
