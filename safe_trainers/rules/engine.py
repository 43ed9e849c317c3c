"""Run the rules: select them, collect their findings, and decide which are raised, reported or applied.

Nothing here acts on a trainer, a config or a command. `run_stage` records the findings in the report it is given and
hands each fix it decides to apply to the `apply` its caller passes: the actions stay at the edge (`stages.py` for
the trainers: a new `TrainerSetup` before construction, the rule's own `apply_built` after it; the OpenRLHF shim's
rewrite of the command).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TypeVar

from ..arguments import SafetyArguments
from ..errors import TRAINER_OPT_OUT, OptOut, SafetyError
from .report import Finding, SafetyReport
from . import DEFAULT_RULES, Rule, check_disabled_ids


T = TypeVar("T")


def select_rules(
    kind: str, settings: SafetyArguments, rules: Iterable[Rule] = DEFAULT_RULES
) -> tuple[list[Rule], list[Rule]]:
    """The rules that apply to `kind`, split into `(enabled, disabled by the user)`. A disabled id that no rule has
    raises a `ValueError` listing the valid ids (settings read from a config that is not a safe config, whose own
    construction checks them)."""
    check_disabled_ids(settings.safety_disable_rules)
    applicable = [r for r in rules if kind in r.trainers]
    disabled = set(settings.safety_disable_rules)
    return [r for r in applicable if r.id not in disabled], [r for r in applicable if r.id in disabled]


def run_stage(
    target: T,
    rules: Iterable[Rule],
    mode: str,
    report: SafetyReport,
    *,
    check: Callable[[Rule, T], Finding | None],
    apply: Callable[[T, Finding], T],
) -> T:
    """Run `check` for each rule on `target` under `safety_mode` `mode`, record the findings in `report`, and return
    the updated target. `apply(target, finding)` carries out a fix and returns the target it gives; it is the only
    call that acts.

    First every rule checks the target as given: blocked findings (in `"strict"` mode every finding but a changed
    library default, see [`Finding.library_default`]) are raised together as one [`SafetyError`] before anything is
    changed, so a fix can never hide a blocking problem. Then, in `"fix"` mode, the rules run again in order and each
    fix is applied before the next rule runs, so later rules see earlier fixes. In `"warn"` mode fixes are reported
    as warnings and nothing changes.
    """
    rules = list(rules)
    opt_out = report.opt_out
    first = [f for f in (check(rule, target) for rule in rules) if f is not None]
    blocked = refused(first, mode, opt_out)
    if blocked:
        raise SafetyError(blocked, opt_out=opt_out)
    if mode == "warn":
        report.findings.extend(unapplied(first, opt_out))
        return target
    late_blocked = []
    for rule in rules:
        finding = check(rule, target)
        if finding is None:
            continue
        if finding.action == "blocked":  # only reachable when an earlier fix created the problem
            late_blocked.append(finding)
        elif finding.action == "fixed":
            target = apply(target, finding)
        report.findings.append(finding)
    if late_blocked:
        raise SafetyError(late_blocked, opt_out=opt_out)
    return target


def refused(findings: Iterable[Finding], mode: str, opt_out: OptOut = TRAINER_OPT_OUT) -> list[Finding]:
    """The findings that stop the stage before anything changes, as `blocked` findings: the blocked ones, and in
    `"strict"` mode every finding about the user's own settings (a changed library default is still applied)."""
    strict = mode == "strict"
    stops = [f for f in findings if f.action == "blocked" or (strict and f.counts_against_user)]
    return [_as_blocked(f, strict, opt_out) for f in stops]


def unapplied(findings: Iterable[Finding], opt_out: OptOut = TRAINER_OPT_OUT) -> list[Finding]:
    """The findings as `"warn"` mode reports them: every fix becomes a warning that says it was not applied."""
    note = f" (not applied: {opt_out.set_mode('warn')})"
    return [replace(f, action="warned", message=f.message + note) if f.action == "fixed" else f for f in findings]


def _as_blocked(finding: Finding, strict: bool, opt_out: OptOut = TRAINER_OPT_OUT) -> Finding:
    if finding.action == "blocked":
        return finding
    suffix = f" (not applied: {opt_out.set_mode('strict')} raises instead of fixing)" if strict else ""
    return replace(finding, action="blocked", message=finding.message + suffix)


def skipped_findings(disabled: Iterable[Rule], opt_out: OptOut = TRAINER_OPT_OUT) -> list[Finding]:
    """`skipped` entries for the rules the user disabled, so the report records every opt-out."""
    return [Finding(r.id, "skipped", f"disabled by {opt_out.setting}.") for r in disabled]


def new_report(kind: str, settings: SafetyArguments, disabled: Iterable[Rule] = ()) -> SafetyReport:
    return SafetyReport(trainer=kind, mode=settings.safety_mode, findings=skipped_findings(disabled))


__all__ = ["new_report", "refused", "run_stage", "select_rules", "skipped_findings", "unapplied"]
