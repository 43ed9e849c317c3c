"""`safe-trainers check`: lint a trainer config for the hardware it will train on, without loading weights or training.

The lint runs where the run is planned, not where it trains: the hardware facts the rules use (bf16 support, GPU
name, CUDA and cuBLAS versions) come from `--target-hardware` and its companions, and the report says what was assumed.
"""

from __future__ import annotations

import argparse
import sys

from ..kinds import TRAINER_KINDS


DEFAULT_TARGET = "a CUDA GPU with bf16 (Ampere or newer), CUDA and cuBLAS versions not given"
EPILOG = """\
examples:
  safe-trainers check --trainer dpo --config c.yaml --model path/to/gemma-2 --fp16 true
  safe-trainers check --trainer grpo --config c.yaml --target-hardware H20 --cuda-version 12.1
  safe-trainers check --trainer dpo --config c.yaml --target-hardware V100 --accelerate-config fp16.yaml
  safe-trainers check --trainer grpo --config c.yaml --target-hardware H100 --num-processes 7

Arguments the check does not know are config overrides (TRL's flags, e.g. `--fp16 true`), as for the launch
scripts; `--` before them is optional.
The check runs nothing the config would: not the model's own code (`trust_remote_code: true`; `config.json` is read as
data unless `--run-model-code` is given), and never the config's `env:` mapping (what it would set is shown).
Exit codes: 0 no finding about your settings (a changed library default, such as TRL's `logging_nan_inf_filter=True`,
is reported apart and does not count), 1 `safety_mode=strict` would fail, 2 the config is invalid for the target.
A `reward_funcs` name the launch scripts cannot build (open-r1's `accuracy`, `code`, ...) is a warning on stderr and
does not change the exit code: the launch scripts refuse it, a script of your own may resolve it."""


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "check",
        help="Print the safety report for a config without training (exit 1 if `safety_mode=strict` would fail).",
        description="Runs the construction-time rules on a YAML config (the same file the launch scripts take) for "
        "the target hardware, and prints what they would change. Only `config.json` and the tokenizer files are read "
        "from the model: no weight is loaded, and none of the model's own code is run unless `--run-model-code`.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an override such as `--model_init_kwargs` must never be read as one of these options
    )
    parser.add_argument("--trainer", required=True, choices=TRAINER_KINDS, help="Which trainer the config is for.")
    parser.add_argument("--config", required=True, help="A YAML config, as taken by `launch/train_<trainer>.py`.")
    parser.add_argument("--model", default=None, help="Model path or id (overrides `model_name_or_path`).")
    parser.add_argument(
        "--run-model-code",
        "--run_model_code",
        dest="run_model_code",
        action="store_true",
        help="With `trust_remote_code: true` in the config, run the model repository's own code "
        "(`configuration_*.py`, `tokenization_*.py`, downloaded from the Hub if needed) to read its config and "
        "tokenizer, as the trainer will. Without it, `config.json` is read as data and the report says so. "
        "(`--trust_remote_code` is TRL's setting here too, as for the launch scripts.)",
    )
    target = parser.add_argument_group(
        "target hardware",
        f"What the run will train on. Default: {DEFAULT_TARGET}. The report says what was assumed.",
    )
    target.add_argument(
        "--target-hardware",
        "--target_hardware",
        dest="target_hardware",
        default=None,
        metavar="GPU",
        help="The GPU the run will use, as `nvidia-smi` names it (H100, A100, H20, L40S, V100, T4, ...), `cpu`, or "
        "`local` for this machine.",
    )
    target.add_argument(
        "--bf16-supported",
        "--bf16_supported",
        dest="bf16_supported",
        type=_bool,
        default=None,
        metavar="BOOL",
        help="Whether the target GPU has bf16 (needed for a GPU the check does not know; overrides the table).",
    )
    target.add_argument("--cuda-version", "--cuda_version", dest="cuda_version", default=None, metavar="V",
                        help="CUDA version of the target's torch build (`torch.version.cuda`), e.g. 12.1.")  # fmt: skip
    target.add_argument(
        "--cublas-version",
        "--cublas_version",
        dest="cublas_version",
        default=None,
        metavar="V",
        help="Version of the `nvidia-cublas-cu12` wheel on the target (`pip show nvidia-cublas-cu12`), e.g. 12.1.3.1.",
    )
    target.add_argument(
        "--accelerate-config",
        "--accelerate_config",
        dest="accelerate_config",
        default=None,
        metavar="FILE",
        help="The accelerate config file the run is launched with: its `mixed_precision` applies when the trainer "
        "config sets neither `fp16` nor `bf16`, as under `accelerate launch --config_file`, and its `num_processes` "
        "(all machines together) sizes the GRPO/RLOO generation batch.",
    )
    target.add_argument(
        "--num-processes",
        "--num_processes",
        dest="num_processes",
        type=int,
        default=None,
        metavar="N",
        help="The total number of training processes (GPUs) over all machines; overrides the accelerate config's.",
    )
    parser.set_defaults(run=run, accepts_overrides=True)


def target_hardware(ns: argparse.Namespace):
    """The [`Hardware`] the lint assumes: the named target, this machine (`local`), or the default GPU."""
    from ..rules.hardware import Hardware

    name = ns.target_hardware
    if name is not None and name.strip().lower() == "local":
        facts = Hardware.detect(probe=False)
        return _with_source(facts, f"this machine: {facts.describe()}")
    if name is None:
        bf16 = True if ns.bf16_supported is None else ns.bf16_supported
        facts = Hardware(accelerator="cuda", bf16_supported=bf16, cuda_version=ns.cuda_version,
                         cublas_version=ns.cublas_version)  # fmt: skip
        if ns.bf16_supported is None and ns.cuda_version is None and ns.cublas_version is None:
            return _with_source(facts, f"{DEFAULT_TARGET} (set it with `--target-hardware`)")
        return _with_source(facts, facts.describe())
    return Hardware.target(
        name, bf16_supported=ns.bf16_supported, cuda_version=ns.cuda_version, cublas_version=ns.cublas_version
    )


def _with_source(facts, source: str):
    import dataclasses

    return dataclasses.replace(facts, source=source)


def run(ns: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes drown the report
    from ..arguments import SafetyArguments
    from ..configs import config_class as kind_config
    from ..kinds import get_kind
    from ..redact import hide_in_text
    from ..scripts.rewards import unbuilt_reward_warning
    from ..scripts.pipeline import has_accelerator, model_and_peft, parse_args
    from ..scripts.preflight import check_argv, settings_problems
    from ..rules.context import build_setup
    from ..rules.stages import built_rule_ids, run_setup_rules
    from . import target

    overrides = list(ns.passthrough)
    if ns.model:
        overrides += ["--model_name_or_path", ns.model]
    try:
        hardware = target_hardware(ns)
        accelerate_config = target.read_yaml(ns.accelerate_config) if ns.accelerate_config else None
        launch = target.launch_from(accelerate_config, ns.num_processes)
        config = dict(check_argv(["--config", ns.config, *overrides]).settings)  # read once, and judged
        config, env = target.hold_env(config)  # TRL's parser would apply it to this process
        config, overrides, held = target.hold_target_fields(config, overrides)
        target_values = target.target_values(held)
    except (ValueError, OSError) as error:
        print(f"safe-trainers check: error: {error}", file=sys.stderr)
        return 2
    launcher_precision = (accelerate_config or {}).get("mixed_precision")
    explicit = target.explicit_fields(config, overrides) | frozenset(held)
    if hardware.accelerator != "cpu" and not has_accelerator():
        # transformers validates bf16 against *this* machine while parsing; the lint is for the target, so parse as
        # a CPU config here (the target's facts, not `use_cpu`, are what the rules read).
        overrides += ["--use_cpu", "true"]
    config_class = target.config_class_for(kind_config(ns.trainer), launch.num_processes, hardware.accelerator)
    problems = target.target_problems(target_values, hardware)
    warnings_, found = [], []
    try:
        with target.config_file(config) as path:
            script_args, training_args, model_args = parse_args(
                ns.trainer, ["--config", path, *overrides], announce_cpu=False, config_class=config_class,
                prog="safe-trainers check",
            )
    except (ValueError, OSError) as error:  # the config itself is invalid (TRL's or transformers' own checks)
        problems.append(hide_in_text(str(error)))  # their messages quote the values they received
    else:
        # The launch scripts' input checks: a bad value fails; what this machine lacks (the model, the dataset) is
        # noted, since the run may train elsewhere. The Hub is decided about here, before `config.json` is read.
        found = settings_problems(script_args, training_args, model_args, say=print)
        problems += [p.message for p in found if not p.local]
        notes = [p.message for p in found if p.local]
        if get_kind(ns.trainer).online:  # a name the launch scripts refuse may be one the user's own script builds
            warnings_ = [w for w in (unbuilt_reward_warning(n, ns.trainer) for n in script_args.reward_funcs) if w]
    if problems:
        detail = " ".join(problems)
        print(f"safe-trainers check: `{ns.config}` is not a valid {ns.trainer} config for the target: {detail}",
              file=sys.stderr)  # fmt: skip
        return 2
    for warning in warnings_:
        print(f"safe-trainers check: warning: {warning}", file=sys.stderr)
    if not (training_args.fp16 or training_args.bf16):
        # What `accelerate launch --config_file` would give the run; the lint is for the launch described by the
        # options, not for this shell (transformers read `ACCELERATE_MIXED_PRECISION` from it while parsing).
        training_args.mixed_precision = str(launcher_precision).lower() if launcher_precision else "no"
    model, training_args, peft_config = model_and_peft(ns.trainer, model_args, training_args)
    setup = build_setup(
        ns.trainer, training_args, model, peft_config=peft_config, hardware=hardware, explicit_args=explicit,
        trust_remote_code=ns.run_model_code,
    )
    settings = SafetyArguments.from_config(training_args)
    _, report = run_setup_rules(setup, settings, raise_blocked=False)
    report.hardware = f"{hardware.source}; {launch.describe()}"
    for note in [*notes, target.env_note(env)]:
        if note:
            print(f"note: {note}")
    if setup.model_config is None and model and not any(p.local and p.setting == "model_name_or_path" for p in found):
        print(
            f"note: could not read `config.json` for `{model}` and its name says no known family; model-specific "
            "rules were not checked."
        )
    print(report.render())
    built = ", ".join(f"`{rule_id}`" for rule_id in built_rule_ids())
    print(f"note: rules that need the loaded model or the tokenized data ({built}) run when the trainer is built.")
    findings = report.user_findings
    blocked = [f for f in findings if f.action == "blocked"]
    if blocked:
        print(f"{len(blocked)} finding(s) would stop construction in every safety mode.", file=sys.stderr)
    if findings:
        print(f"`safety_mode=\"strict\"` would fail with {len(findings)} finding(s).", file=sys.stderr)
        return 1
    return 0
