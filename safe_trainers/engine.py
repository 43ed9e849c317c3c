"""Run the rules: select them, collect findings, decide what to apply or raise. Decisions only, no side effects."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TypeVar

from .arguments import SafetyArguments
from .errors import SafetyError
from .report import Finding, SafetyReport
from .rules import DEFAULT_RULES, Rule


T = TypeVar("T")


def select_rules(kind: str, settings: SafetyArguments, rules: Iterable[Rule] = DEFAULT_RULES) -> tuple[list[Rule], list[Rule]]:
    """The rules that apply to `kind`, split into `(enabled, disabled by the user)`."""
    applicable = [r for r in rules if kind in r.trainers]
    disabled = set(settings.safety_disable_rules)
    return [r for r in applicable if r.id not in disabled], [r for r in applicable if r.id in disabled]


def run_stage(
    target: T,
    rules: Iterable[Rule],
    settings: SafetyArguments,
    report: SafetyReport,
    *,
    check: Callable[[Rule, T], Finding | None],
    apply: Callable[[T, Finding], T],
) -> T:
    """Run `check` for each rule on `target`, record the findings in `report`, and return the updated target.

    In `"fix"` mode each fixed finding is applied before the next rule runs, so later rules see earlier fixes. In
    `"warn"` mode fixes are reported as warnings and nothing changes. In `"strict"` mode every finding blocks. Blocked
    findings are collected and raised together as one [`SafetyError`] at the end of the stage.
    """
    blocked = []
    for rule in rules:
        finding = check(rule, target)
        if finding is None:
            continue
        if settings.safety_mode == "strict" or finding.action == "blocked":
            finding = replace(finding, action="blocked")
            blocked.append(finding)
        elif settings.safety_mode == "warn" and finding.action == "fixed":
            finding = replace(finding, action="warned", message=finding.message + " (not applied: `safety_mode=\"warn\"`)")
        elif finding.action == "fixed":
            target = apply(target, finding)
        report.findings.append(finding)
    if blocked:
        raise SafetyError(blocked)
    return target


def skipped_findings(disabled: Iterable[Rule]) -> list[Finding]:
    """`skipped` entries for the rules the user disabled, so the report records every opt-out."""
    return [Finding(r.id, "skipped", "disabled by `safety_disable_rules`.") for r in disabled]


def new_report(kind: str, settings: SafetyArguments, disabled: Iterable[Rule] = ()) -> SafetyReport:
    return SafetyReport(trainer=kind, mode=settings.safety_mode, findings=skipped_findings(disabled))


__all__ = ["new_report", "run_stage", "select_rules", "skipped_findings"]
