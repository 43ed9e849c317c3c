"""Keys of a `--config` file that no setting of the launch reads: renamed or removed upstream (a recipe written for an
older TRL or transformers), read by another project's script (open-r1's), or misspelled.

TRL's parser refuses them in one list ("Unknown arguments from config file: [...]. Please remove them, add them to the
dataclass, or set `fail_with_unknown_args=False`"), which tells a user of a published recipe neither what each key
became nor what to do. Here each one gets its own line: the key, what happened to it, and the fix. A key is judged
only when none of the launch's dataclasses has it, so a name an installed release still reads is never reported.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
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
    "evaluation_strategy": Retired("eval_strategy", "was renamed `eval_strategy` by transformers",
                                   "Rename it `eval_strategy`."),  # fmt: skip
    "no_cuda": Retired("use_cpu", "was replaced by `use_cpu` in transformers", "Write `use_cpu: true` instead."),
    "max_prompt_length": Retired(
        None,
        "was removed by TRL",
        "Remove it: the DPO, KTO, SFT and reward configs bound the whole sequence with `max_length`; GRPO and RLOO keep "
        "prompts whole (drop over-long prompts from the dataset).",
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


def unknown_key_problems(settings: Mapping[str, Any], known: frozenset[str], versions: str) -> list[InputProblem]:
    """The problems of the config file's keys that no setting reads, one per key, in file order. Pure.

    Args:
        settings (`Mapping[str, Any]`): the `--config` file's top-level mapping.
        known (`frozenset[str]`): the settings of the launch (see [`field_names`]).
        versions (`str`): the installed releases, as the messages name them (`"TRL 1.16.0, transformers 5.23.0"`).
    """
    problems = []
    for key, value in settings.items():
        if key in known or key in PARSER_KEYS:
            continue
        retired = RETIRED.get(key)
        if retired is not None and (retired.now is None or retired.now in known):
            verdict = f"{retired.why}: {versions} have no `{key}`", retired.fix
        elif key in OPEN_R1_SCRIPT_KEYS:
            fix = "Remove it to train with the shipped launch scripts, or run the recipe with open-r1's own script."
            verdict = "is read by open-r1's own script, not by the shipped launch scripts", fix
        else:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
            hint = f"Did you mean `{close[0]}`? " if close else ""
            verdict = f"is not a setting of this launch ({versions})", f"{hint}Fix the name, or remove it."
        problems.append(InputProblem(key, value, *verdict))
    return problems


__all__ = ["OPEN_R1_SCRIPT_KEYS", "RETIRED", "Retired", "field_names", "unknown_key_problems"]
