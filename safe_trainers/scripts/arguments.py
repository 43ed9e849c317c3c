"""The launch scripts' command line: their arguments (TRL's `ScriptArguments` plus reward names), and TRL's parser over
`(ScriptArguments, <safe config of the kind>, ModelConfig)`, whose usage errors and refused settings are one
[`InputError`] (used by `launch/train_<kind>.py` and `safe-trainers check`)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import trl
from trl import ModelConfig, TrlParser

from . import preflight
from .argv import normalize_argv
from .config_keys import field_names, installed_versions, leftover_settings, unknown_key_problems
from .inputs import InputError, InputProblem, raise_problems
from .rewards import BUILTIN_REWARDS, TRL_REWARDS


logger = logging.getLogger("safe_trainers")


@dataclass
class ScriptArguments(trl.ScriptArguments, trl.DatasetMixtureConfig):
    """
    [`~trl.ScriptArguments`] and [`~trl.DatasetMixtureConfig`] (a `datasets:` list in the YAML, as TRL's own scripts
    take it), plus the arguments the GRPO and RLOO scripts need.

    Args:
        reward_funcs (`list[str]`, *optional*, defaults to `["count_words"]`):
            GRPO and RLOO reward functions: built-in names (`count_words`, `length`, `format`, see
            `safe_trainers.scripts.rewards`), TRL's reward names (`accuracy_reward`, `think_format_reward`, ...),
            `module:function` or dotted paths to your own functions, or local reward-model directories.
    """

    reward_funcs: list[str] = field(
        default_factory=lambda: ["count_words"],
        metadata={
            "help": f"GRPO and RLOO reward functions: built-in names ({', '.join(BUILTIN_REWARDS)}), TRL's reward "
            f"names ({', '.join(TRL_REWARDS)}), `module:function` paths to your own functions, or local reward-model "
            "directories."
        },
    )


def has_accelerator() -> bool:
    """Whether a GPU-like device that transformers can train on is present (CUDA, XPU, MPS, NPU or XLA)."""
    import torch
    from transformers.utils import is_torch_npu_available, is_torch_xla_available

    return (
        torch.cuda.is_available()
        or (hasattr(torch, "xpu") and torch.xpu.is_available())
        or torch.backends.mps.is_available()
        or is_torch_npu_available()
        or is_torch_xla_available()
    )


class ScriptParser(TrlParser):
    """TRL's parser, whose usage errors (a flag without its value, a value of the wrong type) raise an [`InputError`]
    of one line instead of printing the usage of every option and exiting."""

    help_command = "python launch/train_<kind>.py --help"  # set per kind by `make_parser`

    def error(self, message: str):
        raise InputError(text=f"{message}. Run `{self.help_command}` for every setting and its type.")


def make_parser(kind: str, config_class: type | None = None, prog: str | None = None) -> TrlParser:
    """TRL's parser over `(ScriptArguments, <safe config of kind>, ModelConfig)`. Without an accelerator, `use_cpu`
    defaults to `True` (a `--config` file or the command line can still set it). `config_class` replaces the safe
    config class (`safe-trainers check` parses with one sized for the target's processes); `prog` names the program
    in messages (`train_<kind>` by default)."""
    from ..configs import config_class as kind_config

    dataclasses = (ScriptArguments, config_class or kind_config(kind), ModelConfig)
    parser = ScriptParser(dataclasses, prog=prog or f"train_{kind}")
    parser.help_command = f"python launch/train_{kind}.py --help"
    if not has_accelerator():
        # transformers refuses bf16 (the TRL default) without a GPU unless `use_cpu=True`.
        parser.set_defaults(use_cpu=True)
    return parser


def parse_args(
    kind: str,
    argv: list[str] | None = None,
    announce_cpu: bool = True,
    config_class: type | None = None,
    prog: str | None = None,
) -> tuple[ScriptArguments, Any, ModelConfig]:
    """Parse `argv` (default `sys.argv[1:]`): an optional YAML `--config` file, then command-line overrides.

    Args:
        kind (`str`):
            The trainer kind (`"sft"`, `"reward"`, `"dpo"`, `"kto"`, `"grpo"` or `"rloo"`): selects the safe config
            class.
        argv (`list[str]`, *optional*):
            The arguments. Launcher-added flags such as `--local_rank=0` are config fields and parse normally.
        announce_cpu (`bool`, *optional*, defaults to `True`):
            Log that training runs on the CPU when there is no accelerator (`safe-trainers check`, which trains
            nothing, turns it off).
        config_class (`type`, *optional*):
            Parse into this subclass of the kind's safe config instead (see [`make_parser`]).
        prog (`str`, *optional*):
            The program named in messages (see [`make_parser`]).

    Returns:
        `tuple[ScriptArguments, Config, ModelConfig]`: script arguments, the safe trainer config (TRL fields plus
        `safety_*` and `nan_*`) and the model arguments.

    Raises:
        InputError: for a `--config` file that cannot be read, a usage error, or a setting the config classes refuse
            (TRL's, transformers' or the `safety_*` and `nan_*` checks), with their message.
    """
    parser = make_parser(kind, config_class, prog)
    argv = normalize_argv(sys.argv[1:] if argv is None else argv)  # `--learning_rate -1e-5`, `--config=x`
    config = preflight.check_argv(argv)
    preflight.check_config_keys(config, parser.dataclass_types, parser.help_command)
    try:
        # The `--config` file's keys were judged before parsing (`check_config_keys`): only the command line's
        # leftovers are left to name.
        *parsed, _, from_command_line = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except InputError:
        raise
    except ValueError as error:  # a config class's own check of a setting (a user's mistake, with its message)
        raise InputError(text=str(error)) from error
    raise_problems(unknown_settings(from_command_line, "on the command line", parser))
    script_args, training_args, model_args = parsed
    if announce_cpu and training_args.use_cpu and not has_accelerator() and training_args.process_index == 0:
        logger.warning("safe_trainers: no GPU found, training on the CPU (`use_cpu=True`).")
    return script_args, training_args, model_args


def unknown_settings(remaining: list[str], where: str, parser: TrlParser) -> list[InputProblem]:
    """The strings the parser did not use (`where` they came from) as problems: each setting named with what became
    of it or the setting meant (see `config_keys`), each stray value as one that belongs to no setting."""
    settings, stray = leftover_settings(remaining)
    known = field_names(parser.dataclass_types)
    problems = unknown_key_problems(settings, known, installed_versions(), where, parser.help_command)
    fix = f"Give it to a setting (`--name value`), or remove it; `{parser.help_command}` lists every setting."
    return problems + [InputProblem("argument", value, f"{where} belongs to no setting", fix) for value in stray]


__all__ = ["ScriptArguments", "ScriptParser", "has_accelerator", "make_parser", "parse_args", "unknown_settings"]
