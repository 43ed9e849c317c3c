"""`sanitize` an OpenRLHF launcher command (pure decisions) and `run` it (the side effects are in `machine.py`).

The flag names come from the OpenRLHF release in use: the installed `openrlhf` package, else `--openrlhf-version`,
else the command's own flag style. When the style fits several generations (e.g. a command with no precision or
attention flag), every rule runs under each of them and the fix valid in all of them is applied, so the shim never
adds a flag a candidate release would reject; a command that would still train to NaN in one candidate is refused
with each release's fix (see `_merge`).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

from ..argument_checks import SAFETY_MODES
from ..rules.engine import run_stage, skipped_findings
from ..errors import SafetyError
from ..rules.report import SHIM_OPT_OUT, Finding, SafetyReport
from ..rules.base import Rule
from .command import CommandError, CommandView, OpenRLHFCommand, apply_changes, model_paths, parse_command
from .flags import ENTRY_POINTS, Generation, generation_for_version
from .generation_detection import detect_generations
from .machine import installed_openrlhf_version, launch, local_bf16_support
from .models import ModelInfo, inspect_model, read_config
from .rules import RULES, rule_ids


@dataclass(frozen=True)
class Plan:
    """What `sanitize` decided.

    Args:
        argv (`list[str]`): the command to run (rewritten in `"fix"` mode, the original otherwise).
        report (`SafetyReport`): the findings.
        command (`OpenRLHFCommand | None`): the parsed original command (`None` in `"off"` mode).
        generations (`tuple[Generation, ...]`): the flag generations the rules used, newest first.
        version_source (`str`): how the generation was chosen.
        models (`tuple[ModelInfo, ...]`): the models the rules saw.
        notes (`tuple[str, ...]`): remarks for the user that are not findings.
    """

    argv: list[str]
    report: SafetyReport
    command: OpenRLHFCommand | None = None
    generations: tuple[Generation, ...] = ()
    version_source: str = ""
    models: tuple[ModelInfo, ...] = ()
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: entry point, flag generation and where it came from, models."""
        if self.command is None:
            return "safe-trainers openrlhf: running the command unchanged."
        versions = " or ".join(str(g) for g in self.generations)
        models = ", ".join(m.describe() for m in self.models) or "none named"
        return (
            f"safe-trainers openrlhf: `{self.command.launcher[-1]}` with the flag names of OpenRLHF {versions} "
            f"({self.version_source}); models: {models}."
        )


def _generations(command: OpenRLHFCommand, version: str | None, installed: str | None):
    """`(generations, source, notes)` for the command."""
    notes: list[str] = []
    if installed or version:
        chosen = generation_for_version(installed or version)
        source = f"installed openrlhf {installed}" if installed else f"`--openrlhf-version {version}`"
        try:
            style, told = detect_generations(command)
        except CommandError as error:
            notes.append(f"the command's flags do not fit one OpenRLHF release: {error}")
        else:
            if chosen not in style:
                notes.append(
                    f"the command's flags ({told}) are those of OpenRLHF {' or '.join(str(g) for g in style)}, but "
                    f"the rules use the names of {chosen} ({source}); OpenRLHF may reject the command."
                )
        return (chosen,), source, notes
    style, told = detect_generations(command)
    return style, f"from the flags: {told}", notes


def _merge(findings: list[Finding | None], generations: tuple[Generation, ...]) -> Finding | None:
    """One finding from a rule run under each candidate generation (pure).

    Kept as is when they agree. Otherwise the fix valid in every candidate is applied: the changes common to all of
    them (same flag, same values, so every candidate release accepts them). What one candidate needs beyond that would
    be a flag another candidate rejects; since the command would train to NaN in that release, it is blocked, naming
    the extra changes and `--openrlhf-version`. A warning in some candidates and nothing in others stays a warning.
    """
    keys = [None if f is None else (f.action, f.changes) for f in findings]
    if all(key == keys[0] for key in keys):
        return findings[0]
    present = [(g, f) for g, f in zip(generations, findings) if f is not None]
    first = present[0][1]
    fits = " or ".join(str(g) for g in generations)
    pin = "Pass `--openrlhf-version` (or install openrlhf) so that the rules use that release's flag names."
    blocked = next((f for _, f in present if f.action == "blocked"), None)
    if blocked is not None:
        which = " or ".join(str(g) for g, f in present if f.action == "blocked")
        where = f"(In OpenRLHF {which}; the command's flags fit {fits}.)"
        return replace(blocked, message=f"{blocked.message} {where} {pin}")
    if all(f.action == "warned" for _, f in present):
        return first
    change_sets = [set(f.changes) if f is not None and f.action == "fixed" else set() for f in findings]
    common = tuple(c for c in first.changes if all(c in changes for changes in change_sets))
    extra = {g: [c for c in f.changes if c not in common] for g, f in present if f.action == "fixed"}
    extra = {g: changes for g, changes in extra.items() if changes}
    if not extra:
        return replace(first, changes=common)
    needs = "; ".join(f"OpenRLHF {g} needs {', '.join(c.render() for c in changes)}" for g, changes in extra.items())
    applied = f" Valid in every candidate release: {', '.join(c.render() for c in common)}." if common else ""
    return Finding(
        first.rule_id,
        "blocked",
        f"{first.message} The command's flags fit OpenRLHF {fits}, and the fix differs between them: {needs}, a flag "
        f"the other release(s) reject, and without it that release trains to NaN.{applied} {pin}",
    )


def plan(
    argv: Sequence[str],
    version: str | None = None,
    mode: str = "fix",
    disabled: Iterable[str] = (),
    *,
    installed: Callable[[], str | None] | None = None,
    reader: Callable[[str], dict[str, Any] | None] = read_config,
    bf16_supported: bool | None = None,
) -> Plan:
    """Decide what to run. See [`sanitize`]; this also returns the parsed command, generations and models.

    `installed` returns the installed OpenRLHF version (default: `importlib.metadata`), `reader` reads a local
    model's `config.json`, `bf16_supported` says whether the GPUs have bf16 (`None`: unknown, assumed yes).

    Raises:
        `CommandError`: the command cannot be read (nothing may run).
        `SafetyError`: a rule blocked the command, or `mode="strict"` and a rule found something.
        `ValueError`: unknown `mode`, rule id or version.
    """
    argv = [str(token) for token in argv]
    disabled = list(disabled)
    if mode not in SAFETY_MODES:
        raise ValueError(f"`--safety-mode` must be one of {list(SAFETY_MODES)}, got {mode!r}.")
    unknown = sorted(set(disabled) - set(rule_ids()))
    if unknown:
        valid = ", ".join(rule_ids())
        raise ValueError(f"unknown rule ids {unknown} in `--safety-disable-rules`. Valid ids: {valid}.")
    if not argv:
        raise CommandError("no command given: put the OpenRLHF launcher command after `--`.")
    if mode == "off":
        return Plan(argv, SafetyReport(trainer="openrlhf", mode=mode, opt_out=SHIM_OPT_OUT))

    command = parse_command(argv)
    if command.entry not in ENTRY_POINTS:  # e.g. `openrlhf.cli.lora_combiner`: nothing the rules know to read
        note = f"no rule applies to `{command.launcher[-1]}` (the rules know {', '.join(ENTRY_POINTS)}); run as given."
        return Plan(argv, SafetyReport(trainer="openrlhf", mode=mode, opt_out=SHIM_OPT_OUT), notes=(note,))
    generations, source, notes = _generations(command, version, (installed or installed_openrlhf_version)())
    pairs = dict.fromkeys(pair for g in generations for pair in model_paths(CommandView(command, g)))
    models = tuple(inspect_model(flag, path, reader) for flag, path in pairs)
    views = [CommandView(command, g, models, bf16_supported) for g in generations]
    for view in views:
        view.validate()

    def check(rule: Rule, current: OpenRLHFCommand) -> Finding | None:
        return _merge([rule.check(CommandView(current, g, models, bf16_supported)) for g in generations], generations)

    def apply(current: OpenRLHFCommand, finding: Finding) -> OpenRLHFCommand:
        return apply_changes(current, finding.changes, generations[0])

    enabled = [rule for rule in RULES if rule.id not in disabled]
    skipped = skipped_findings((r for r in RULES if r.id in disabled), SHIM_OPT_OUT)
    report = SafetyReport(trainer="openrlhf", mode=mode, findings=skipped, opt_out=SHIM_OPT_OUT)
    final = run_stage(command, enabled, mode, report, check=check, apply=apply)
    new_argv = final.argv if mode == "fix" else argv
    return Plan(new_argv, report, command, generations, source, models, tuple(notes))


def sanitize(
    argv: Sequence[str], version: str | None = None, mode: str = "fix", disabled: Iterable[str] = (), **kwargs: Any
) -> tuple[list[str], SafetyReport]:
    """Apply the OpenRLHF rules to a launcher command.

    Args:
        argv (`Sequence[str]`): the full launcher command, e.g. `["deepspeed", "--module", "openrlhf.cli.train_rm",
            "--pretrain", "google/gemma-2-2b-it", "--flash_attn"]`.
        version (`str`, *optional*): the OpenRLHF release (`--openrlhf-version`), used when openrlhf is not installed.
        mode (`str`, *optional*, defaults to `"fix"`): `"fix"`, `"warn"`, `"strict"` or `"off"`.
        disabled (`Iterable[str]`, *optional*): rule ids to skip.
        **kwargs: `installed`, `reader` and `bf16_supported`, see [`plan`].

    Returns:
        `tuple[list[str], SafetyReport]`: the command to run and the report.

    Example:
        ```python
        >>> argv, report = sanitize(["deepspeed", "--module", "openrlhf.cli.train_rm", "--pretrain",
        ...                          "google/gemma-2-2b-it", "--bf16", "--flash_attn"], installed=lambda: None)
        >>> argv
        ['deepspeed', '--module', 'openrlhf.cli.train_rm', '--pretrain', 'google/gemma-2-2b-it', '--bf16']
        ```
    """
    result = plan(argv, version, mode, disabled, **kwargs)
    return result.argv, result.report


def run(
    argv: Sequence[str],
    version: str | None = None,
    mode: str = "fix",
    disabled: Iterable[str] = (),
    *,
    dry_run: bool = False,
    runner: Callable[..., Any] = launch,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    **kwargs: Any,
) -> int:
    """Sanitize `argv`, print the report (stderr), then run the command as an argument list, never through a shell,
    in its own process group: SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1/2 sent to this process are passed on to it.

    Returns:
        `int`: the command's exit code (128 + N when killed by signal N); 0 for `dry_run` (the command is printed to
        stdout with `shlex.join`); 1 when a rule blocks it; 2 when it cannot be read; 127 when the launcher is
        missing, 126 when it cannot be executed (the shell's codes).
    """
    out, err = stdout or sys.stdout, stderr or sys.stderr
    if "bf16_supported" not in kwargs:
        kwargs["bf16_supported"] = local_bf16_support()
    try:
        result = plan(argv, version, mode, disabled, **kwargs)
    except SafetyError as error:
        print(str(error), file=err)
        return 1
    except ValueError as error:
        print(f"safe-trainers openrlhf: error: {error}", file=err)
        return 2
    print(result.describe(), file=err)
    for note in result.notes:
        print(f"safe-trainers openrlhf: note: {note}", file=err)
    print(result.report.render(), file=err)
    if dry_run:
        print(shlex.join(result.argv), file=out)
        return 0
    out.flush()
    err.flush()
    try:
        completed = runner(list(result.argv))
    except FileNotFoundError:
        print(f"safe-trainers openrlhf: error: `{result.argv[0]}` was not found on PATH; nothing was run.", file=err)
        return 127
    except PermissionError:  # a job script without its executable bit, or a directory
        launcher = result.argv[0]
        print(f"safe-trainers openrlhf: error: `{launcher}` cannot be executed (permission denied): make it "
              f"executable (`chmod +x {launcher}`) or name its interpreter first; nothing was run.",
              file=err)  # fmt: skip
        return 126
    except KeyboardInterrupt:
        return 130
    code = int(completed.returncode)
    return 128 - code if code < 0 else code


__all__ = ["Plan", "installed_openrlhf_version", "launch", "plan", "run", "sanitize"]
