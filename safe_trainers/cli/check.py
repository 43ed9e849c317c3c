"""`safe-trainers check`: lint a trainer config with the safety rules, without loading weights or training."""

from __future__ import annotations

import argparse
import sys

from ..kinds import TRAINER_KINDS


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "check",
        help="Print the safety report for a config without training (exit 1 if `safety_mode=strict` would fail).",
        description="Runs the construction-time rules on a YAML config (the same file the launch scripts take) and "
        "prints what they would change. Only `config.json` is read from the model: no weight is loaded. Extra "
        "arguments after the options are parsed as config overrides, e.g. `--fp16 true`.",
    )
    parser.add_argument("--trainer", required=True, choices=TRAINER_KINDS, help="Which trainer the config is for.")
    parser.add_argument("--config", required=True, help="A YAML config, as taken by `launch/train_<trainer>.py`.")
    parser.add_argument("--model", default=None, help="Model path or id (overrides `model_name_or_path`).")
    parser.set_defaults(run=run)
    parser.epilog = "Exit codes: 0 no finding, 1 `safety_mode=strict` would fail, 2 the config itself is invalid."


def run(ns: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes drown the report
    from ..engine import new_report, run_stage, select_rules
    from ..apply import apply_to_setup
    from ..arguments import SafetyArguments
    from ..errors import SafetyError
    from ..scripts import model_and_peft, parse_args
    from ..setup import build_setup

    overrides = list(ns.passthrough)
    if ns.model:
        overrides += ["--model_name_or_path", ns.model]
    try:
        _, training_args, model_args = parse_args(ns.trainer, ["--config", ns.config, *overrides])
    except (ValueError, OSError) as error:  # the config itself is invalid (TRL's or transformers' own checks)
        print(f"safe-trainers check: `{ns.config}` is not a valid {ns.trainer} config: {error}", file=sys.stderr)
        return 2
    model, training_args, peft_config = model_and_peft(ns.trainer, model_args, training_args)
    setup = build_setup(ns.trainer, training_args, model, peft_config=peft_config)
    settings = SafetyArguments.from_config(training_args)
    enabled, disabled = select_rules(ns.trainer, settings)
    report = new_report(ns.trainer, settings, disabled)
    if settings.safety_mode != "off":
        try:
            run_stage(setup, enabled, settings, report, check=lambda r, s: r.check(s), apply=apply_to_setup)
        except SafetyError as error:
            report.findings.extend(error.findings)
    if setup.model_config is None and model:
        print(f"note: could not read `config.json` for `{model}`; model-specific rules were not checked.")
    print(report.render())
    print(
        "note: rules that need the loaded model or the tokenized data (`data.no_loss_tokens`, the reward head "
        "check, `precision.fp32_trainable_params`) run when the trainer is built."
    )
    findings = [f for f in report.findings if f.action != "skipped"]
    blocked = [f for f in findings if f.action == "blocked"]
    if blocked:
        print(f"{len(blocked)} finding(s) would stop construction in every safety mode.", file=sys.stderr)
    if findings:
        print(f"`safety_mode=\"strict\"` would fail with {len(findings)} finding(s).", file=sys.stderr)
        return 1
    return 0
