"""Settings that no dataclass of the launch reads, in the `--config` file or on the command line: renamed or removed
upstream (a recipe written for an older TRL or transformers), read by another project's script (open-r1's), or
misspelled.

TRL's parser refuses them in one list ("Unknown arguments from config file: [...]. Please remove them, add them to the
dataclass, or set `fail_with_unknown_args=False"`; on the command line, "Some specified arguments are not used by the
HfArgumentParser"), which tells a user of a published recipe neither what each key became nor what to do. Here each
one gets its own line: the setting, where it came from, what happened to it, and the fix. A name is judged only when
none of the launch's dataclasses has it, so a setting an installed release still reads is never reported.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .inputs import InputProblem


@dataclass(frozen=True)
class Retired:
    """A setting that is no more: `now` is the setting that took its place (`None` when none did), `why` completes
    "`key` ...", `fix` says what to do."""

    now: str | None
    why: str
    fix: str


RETIRED: dict[str, Retired] = {
    "torch_dtype": Retired("dtype", "was renamed `dtype` by transformers", "Rename it `dtype` (same values)."),
    "max_seq_length": Retired("max_length", "was renamed `max_length` by TRL", "Rename it `max_length`."),
    "use_liger": Retired("use_liger_kernel", "was renamed `use_liger_kernel` by TRL", "Rename it `use_liger_kernel`."),
    "rloo_k": Retired("num_generations", "was renamed `num_generations` by TRL", "Rename it `num_generations`."),
    "evaluation_strategy": Retired(
        "eval_strategy", "was renamed `eval_strategy` by transformers", "Rename it `eval_strategy`."
    ),
    "no_cuda": Retired("use_cpu", "was replaced by `use_cpu` in transformers", "Write `use_cpu: true` instead."),
    "max_prompt_length": Retired(
        None,
        "was removed by TRL",
        "Remove it: the DPO, KTO, SFT and reward configs bound the whole sequence with `max_length`; GRPO and RLOO "
        "keep prompts whole (drop over-long prompts from the dataset).",
    ),
    "max_completion_length": Retired(
        None,
        "was removed from the DPO and KTO configs by TRL",
        "Remove it: `max_length` bounds prompt and completion together.",
    ),
    "overwrite_output_dir": Retired(
        None,
        "was removed by transformers 5",
        "Remove it; to start afresh in a used `output_dir`, empty it or pass another one.",
    ),
    "logging_dir": Retired(
        None,
        "was removed by transformers 5",
        "Remove it, and set the `TENSORBOARD_LOGGING_DIR` environment variable for TensorBoard's folder.",
    ),
}

# Read by open-r1's `grpo.py`/`sft.py` (its own script arguments), not by TRL's dataclasses.
OPEN_R1_SCRIPT_KEYS = frozenset({
    "dataset_prompt_column", "system_prompt", "chat_template", "benchmarks", "callbacks", "wandb_entity",
    "wandb_project", "wandb_run_group", "cosine_min_value_wrong", "cosine_max_value_wrong", "cosine_min_value_correct",
    "cosine_max_value_correct", "cosine_max_len", "repetition_n_grams", "repetition_max_penalty", "code_language",
    "code_eval_test_batch_size", "code_eval_scoring_mode", "parallel_code_exec_per_proc", "code_provider",
    "ioi_provider", "max_completion_len", "soft_punish_cache", "e2b_router_url", "morph_router_url",
})  # fmt: skip

# Keys TRL's parser itself consumes before the dataclasses see the file.
PARSER_KEYS = frozenset({"env"})


def field_names(dataclass_types: Iterable[type]) -> frozenset[str]:
    """Every field name of the given dataclasses: the settings a config file may hold."""
    return frozenset(f.name for cls in dataclass_types for f in dataclasses.fields(cls))


def installed_versions() -> str:
    """The installed TRL and transformers releases, as the messages name them (`"TRL 1.16.0, transformers 5.23.0"`)."""
    import transformers
    import trl

    return f"TRL {trl.__version__}, transformers {transformers.__version__}"


def unknown_key_problems(
    settings: Mapping[str, Any], known: frozenset[str], versions: str, where: str = "in the `--config` file",
    help_command: str | None = None,
) -> list[InputProblem]:  # fmt: skip
    """The problems of the settings no dataclass reads, one per name, in the order given. Pure.

    Args:
        settings (`Mapping[str, Any]`): the settings given, by name (the `--config` file's top-level mapping, or the
            command line's leftovers, see [`leftover_settings`]).
        known (`frozenset[str]`): the settings of the launch (see [`field_names`]).
        versions (`str`): the installed releases, as the messages name them (`"TRL 1.16.0, transformers 5.23.0"`).
        where (`str`): where the settings came from, as the messages say it.
        help_command (`str`, *optional*): the command that lists every setting, named in the fix of a misspelling.
    """
    problems = []
    listed = f"; `{help_command}` lists every setting" if help_command else ""
    for key, value in settings.items():
        if key in known or key in PARSER_KEYS:
            continue
        retired = RETIRED.get(key)
        if retired is not None and (retired.now is None or retired.now in known):
            verdict = f"{where} {retired.why}: {versions} have no `{key}`", retired.fix
        elif key in OPEN_R1_SCRIPT_KEYS:
            fix = "Remove it to train with the shipped launch scripts, or run the recipe with open-r1's own script."
            verdict = f"{where} is read by open-r1's own script, not by the shipped launch scripts", fix
        else:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
            hint = f"Did you mean `{close[0]}`? " if close else ""
            fix = f"{hint}Fix the name, or remove it{listed}."
            verdict = f"{where} is not a setting of this launch ({versions})", fix
        problems.append(InputProblem(key, value, *verdict))
    return problems


def leftover_settings(remaining: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The strings a parser did not use, as settings (`--name value`, `--name=value`; `None` for a flag without a
    value, `-` in a name read as `_`) and the values that follow no setting. Pure."""
    settings: dict[str, Any] = {}
    stray: list[str] = []
    name = None
    for token in remaining:
        if token.startswith("--"):
            key, has_value, value = token[2:].partition("=")
            name = None if has_value else key.replace("-", "_")
            settings[key.replace("-", "_")] = value if has_value else None
        elif name is not None:
            settings[name], name = token, None
        else:
            stray.append(token)
    return settings, stray


__all__ = ["OPEN_R1_SCRIPT_KEYS", "RETIRED", "Retired", "field_names", "installed_versions", "leftover_settings",
           "unknown_key_problems"]  # fmt: skip
