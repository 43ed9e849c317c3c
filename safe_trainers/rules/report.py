"""What the safety rules found and changed: `Change`, `Finding` and `SafetyReport`.

A finding is data. Rule checks return findings and never act; the stages apply the changes a finding carries (after
construction through the rule's own `apply_built`) and the report records them, so the same rule can lint a YAML file,
configure a trainer or rewrite a launcher command.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import TRAINER_OPT_OUT, OptOut
from ..runtime.files import write_text_no_follow
from ..redact import mask_secret


Action = Literal["fixed", "warned", "blocked", "skipped"]


SHIM_OPT_OUT = OptOut(
    setting="`--safety-disable-rules`", disable="`--safety-disable-rules <rule id>`", mode="`--safety-mode {mode}`"
)


class _Removed:
    """Sentinel for a setting that a change deletes (e.g. a renamed `model_init_kwargs` key)."""

    def __repr__(self) -> str:
        return "<removed>"


REMOVED: Any = _Removed()


@dataclass(frozen=True)
class Change:
    """One setting changed by a rule.

    Args:
        path (`str`):
            Where the setting lives, e.g. `"args.bf16"`, `"args.model_init_kwargs.dtype"`, `"peft_config.task_type"`,
            `"model.attn_implementation"`, `"argv.--vanilla_loss"`.
        old (`Any`):
            The value before the change (`REMOVED` if the setting did not exist).
        new (`Any`):
            The value after the change (`REMOVED` if the setting is deleted).

    A credential's value (`args.hub_token`, a `token` in `model_init_kwargs`) is shown as `<hidden>` in the summary and
    in the JSON report (see [`~safe_trainers.redact.mask_secret`]).
    """

    path: str
    old: Any
    new: Any

    def render(self) -> str:
        return f"{self.path}: {_short(self.shown(self.old))} -> {_short(self.shown(self.new))}"

    def shown(self, value: Any) -> Any:
        """`value` (`old` or `new`) as the report shows it: a credential's hidden."""
        return value if value is REMOVED else mask_secret(self.path, value)


@dataclass(frozen=True)
class Finding:
    """What one rule found.

    Args:
        rule_id (`str`):
            The stable id of the rule, e.g. `"precision.bf16_over_fp16"`.
        action (`str`):
            `"fixed"` (the changes are applied), `"warned"` (reported, nothing changed), `"blocked"` (construction
            fails with a [`SafetyError`]) or `"skipped"` (the rule was disabled by the user).
        message (`str`):
            What was found, why it matters, and the fix, in TRL's style.
        changes (`tuple[Change, ...]`):
            The settings the rule changes when `action="fixed"`.
        data (`dict`):
            Extra machine-readable detail for the code that applies the changes (e.g. dataset rows to drop).
        library_default (`bool`, *optional*, defaults to `False`):
            The finding is about a library default the user never set (e.g. TRL's `logging_nan_inf_filter=True`), not
            about the user's own settings. It is applied and reported like any fix, but listed apart, and it never
            fails `safety_mode="strict"` or `safe-trainers check`.
    """

    rule_id: str
    action: Action
    message: str
    changes: tuple[Change, ...] = ()
    data: dict[str, Any] = field(default_factory=dict, compare=False)
    library_default: bool = False

    @property
    def counts_against_user(self) -> bool:
        """Whether the finding is about the user's own settings: fails `strict` and `check` (skips never do)."""
        return self.action != "skipped" and not self.library_default

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule_id": self.rule_id,
            "action": self.action,
            "message": self.message,
            "changes": [
                {"path": c.path, "old": _jsonable(c.shown(c.old)), "new": _jsonable(c.shown(c.new))}
                for c in self.changes
            ],
            "library_default": self.library_default,
        }


@dataclass
class SafetyReport:
    """The findings of one construction (or one `safe-trainers check`), in rule order.

    Args:
        trainer (`str`):
            The trainer kind: `"reward"`, `"dpo"`, `"kto"`, `"grpo"` or `"openrlhf"`.
        mode (`str`):
            The `safety_mode` the rules ran under.
        findings (`list[Finding]`):
            Every finding, including `"skipped"` entries for rules the user disabled.
        opt_out ([`OptOut`]):
            How the reader switches rules off (config fields, or the OpenRLHF shim's flags).
        hardware (`str | None`):
            The hardware the rules assumed, when it is not the machine the report is made on (`safe-trainers check`).
        notes (`list[str]`):
            Other assumptions the rules made, e.g. a model family inferred from the model's name.
    """

    trainer: str
    mode: str
    findings: list[Finding] = field(default_factory=list)
    opt_out: OptOut = field(default=TRAINER_OPT_OUT, compare=False)
    hardware: str | None = None
    notes: list[str] = field(default_factory=list)

    def by_rule(self, rule_id: str) -> list[Finding]:
        return [f for f in self.findings if f.rule_id == rule_id]

    @property
    def changes(self) -> list[Change]:
        return [c for f in self.findings if f.action == "fixed" for c in f.changes]

    @property
    def user_findings(self) -> list[Finding]:
        """The findings about the user's own settings: what `safety_mode="strict"` and `check` fail on."""
        return [f for f in self.findings if f.counts_against_user]

    def render(self) -> str:
        """The one summary shown to the user (main process only)."""
        own = [f for f in self.findings if not f.library_default]
        defaults = [f for f in self.findings if f.library_default]
        counts = {a: sum(f.action == a for f in own) for a in ("fixed", "warned", "blocked", "skipped")}
        counts["library default changed"] = len(defaults)
        assumed = [f"  hardware assumed: {self.hardware}"] if self.hardware else []
        assumed += [f"  note: {note}" for note in self.notes]
        if self.mode == "off":
            return f"safe_trainers ({self.trainer}): safety rules are off ({self.opt_out.set_mode('off')})."
        if not self.findings:
            return "\n".join([f"safe_trainers ({self.trainer}): all safety rules passed, nothing changed.", *assumed])
        parts = [f"{n} {name}" for name, n in counts.items() if n]
        lines = [f"safe_trainers ({self.trainer}, safety_mode={self.mode!r}): " + ", ".join(parts) + ".", *assumed]
        width = max(len(f.rule_id) for f in self.findings)
        lines += _render_findings(own, width)
        if defaults:
            lines.append("  Library defaults you did not set (changed, never a failure in `strict` mode or `check`):")
            lines += _render_findings(defaults, width)
        lines.append(f"  Disable a rule with {self.opt_out.disable}.")
        return "\n".join(lines)

    def construction_summary(self, rules_run: int, nan_guard: bool, path: str, snapshots: str | None = None) -> str:
        """What the main process prints when a trainer is built: the whole report when a rule fixed or warned of
        something, else one line saying how many rules ran and that none fired (and which were disabled), whether the
        NaN guard is on, and where the report file is (then the report's notes, if any).

        Args:
            rules_run (`int`): how many rules ran for this trainer (those of its kind, less the disabled ones).
            nan_guard (`bool`): whether the NaN guard watches the run.
            path (`str`): where the report was written.
            snapshots (`str`, *optional*): how often the guard takes its snapshots (`guard/snapshot_interval.py`).
        """
        if any(f.action in ("fixed", "warned") for f in self.findings):
            return self.render()
        if self.mode == "off":
            rules = f"safety rules are off ({self.opt_out.set_mode('off')})"
        else:
            rules = f"{rules_run} safety rules run, none fired"
            skipped = [f"`{f.rule_id}`" for f in self.findings if f.action == "skipped"]
            rules += f" ({len(skipped)} disabled: {', '.join(skipped)})" if skipped else ""
        guard = "NaN guard off (`nan_guard=False`)"
        if nan_guard:
            guard = f"NaN guard on ({snapshots})" if snapshots else "NaN guard on"
        line = f"safe_trainers ({self.trainer}): {rules}; {guard}; report in {path}."
        return "\n".join([line, *(f"  note: {note}" for note in self.notes)])

    def to_dict(self) -> dict[str, Any]:
        data = {"trainer": self.trainer, "mode": self.mode, "findings": [f.to_dict() for f in self.findings]}
        if self.hardware:
            data["hardware"] = self.hardware
        if self.notes:
            data["notes"] = list(self.notes)
        return data

    def write_json(self, output_dir: str, filename: str = "safety_report.json") -> str:
        """Write the report as JSON in `output_dir` (created if missing) and return the file path."""
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, filename)
        write_text_no_follow(path, json.dumps(self.to_dict(), indent=2))  # a link there is replaced, not followed
        return path


def _render_findings(findings: list[Finding], width: int) -> list[str]:
    lines = []
    for f in findings:
        lines.append(f"  [{f.action}] {f.rule_id:<{width}}  {f.message}")
        lines.extend(f"  {'':<{len(f.action) + 2}} {'':<{width}}    {c.render()}" for c in f.changes)
    return lines


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    if value is REMOVED:
        return "<removed>"
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


__all__ = ["Action", "Change", "Finding", "OptOut", "REMOVED", "SHIM_OPT_OUT", "SafetyReport", "TRAINER_OPT_OUT"]
