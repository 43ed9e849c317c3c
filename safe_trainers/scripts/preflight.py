"""The input checks at work: observe this machine, judge each stage with the table of
[`~safe_trainers.scripts.inputs`], and raise one [`InputError`] per stage with every problem found.

Shared by the launch scripts (`scripts.pipeline`, every problem is fatal) and `safe-trainers check` (a problem with
what this machine holds is a note there).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import hub, places
from .argv import config_path, flag_value
from .config_keys import field_names, installed_versions, unknown_key_problems
from .inputs import INPUT_CHECKS, DataShape, Facts, InputError, InputProblem, judge, raise_problems
from .rewards import reward_name_problem


def check_argv(argv: Sequence[str]) -> places.ConfigFile | None:
    """The `"argv"` stage: the `--config` file, before TRL's parser opens it, and the `--deepspeed` JSON file it or
    the command line names, before transformers reads it.

    Raises:
        InputError: when a file is missing, a directory, unreadable, or not a mapping of settings.
    """
    path = config_path(argv)
    config = places.read_config_file(path) if path is not None else None
    deepspeed = flag_value(argv, "deepspeed")
    if deepspeed is None and config is not None:
        deepspeed = config.settings.get("deepspeed")
    values: dict[str, Any] = {"config": path} if path is not None else {}
    ds_file = None
    if isinstance(deepspeed, str) and deepspeed.lower().endswith(".json"):  # not a dict nor base64 JSON
        values["deepspeed"], ds_file = deepspeed, places.read_config_file(deepspeed)
    raise_problems(judge("argv", values, Facts(config=config, deepspeed=ds_file)))
    return config


def check_config_keys(
    config: places.ConfigFile | None, dataclass_types: Sequence[type], help_command: str | None = None
) -> None:
    """The keys of the `--config` file ([`check_argv`] read it) that none of `dataclass_types` reads (renamed or
    removed upstream, another script's, misspelled), one line each with its fix, before TRL's parser refuses them in
    one list.

    Raises:
        InputError: naming each such key.
    """
    if config is not None:
        known = field_names(dataclass_types)
        raise_problems(unknown_key_problems(config.settings, known, installed_versions(), help_command=help_command))


def hub_names(script_args: Any, model_args: Any) -> list[str]:
    """The model and dataset names of a parsed launch (a `datasets:` mixture's paths included)."""
    names = [model_args.model_name_or_path, script_args.dataset_name]
    names += [getattr(entry, "path", None) for entry in (getattr(script_args, "datasets", None) or [])]
    return [name for name in names if name]


def settings_problems(
    script_args: Any, training_args: Any, model_args: Any, say: Callable[[str], None] | None = None
) -> list[InputProblem]:
    """The `"settings"` stage: the problems of the parsed settings, before anything is loaded.

    The Hub is decided about here, once, and only when a name can only be found through it (`hub.hub_access`); when
    it cannot be used, `say` gets the one line that tells the user the run goes on offline.
    """
    access = None
    if places.needs_hub(hub_names(script_args, model_args)):
        access = hub.hub_access()
        line = access.announcement(program_name())
        if line and say is not None:
            say(line)
    online = access is None or access.online
    model, dataset = model_args.model_name_or_path, script_args.dataset_name
    facts = Facts(
        model=places.observe(model, "model", online) if model else None,
        dataset=places.observe(dataset, "dataset", online) if dataset and not script_args.datasets else None,
        hub=access,
        checkpoint=places.local(str(training_args.resume_from_checkpoint or "")),
    )
    # Every setting the table judges at this stage, from the argument objects that have it (the model's and the
    # script's arguments win over the trainer config, as the names the user set are theirs).
    sources = (training_args, script_args, model_args)
    judged = {row.setting for row in INPUT_CHECKS if row.stage == "settings"}
    values = {name: getattr(source, name) for name in judged for source in sources if hasattr(source, name)}
    return judge("settings", values, facts)


def check_settings(script_args: Any, training_args: Any, model_args: Any) -> None:
    """[`settings_problems`] for a launch: every problem is fatal; the offline line goes to the main process's
    stderr.

    Raises:
        InputError: with every problem found.
    """
    raise_problems(settings_problems(script_args, training_args, model_args, say=say_once))


def check_reward_names(names: Sequence[str]) -> None:
    """The reward names a launch script cannot build, refused before any data or weight is loaded (`safe-trainers
    check` warns about the same names instead: a script of the user's own may resolve them).

    Raises:
        InputError: naming each such reward and what to pass instead.
    """
    refused = [problem for problem in map(reward_name_problem, names) if problem is not None]
    if refused:
        raise InputError(text=" ".join(refused))


def check_data(kind: str, name: str | None, dataset: Any, split: str, training_args: Any) -> None:
    """The `"data"` stage: a loaded split has rows and the columns the trainer of `kind` reads.

    Raises:
        InputError: when it has no rows or lacks the columns.
    """
    rows = len(dataset) if hasattr(dataset, "__len__") else None
    columns = tuple(getattr(dataset, "column_names", None) or ())
    text_field = getattr(training_args, "dataset_text_field", "text") or "text"
    shape = DataShape(kind, split, rows, columns, text_field)
    raise_problems(judge("data", {"dataset_name": name or "(the `datasets` mixture)"}, Facts(data=shape)))


def load_error(name: str | None, error: Exception) -> InputError | None:
    """The user-facing error for a dataset that failed to load, or `None` when the failure is not about the input:
    a Hub dataset that offline mode could not find, or a local file that `datasets` could not read."""
    from huggingface_hub import constants

    if not name:
        return None
    if os.path.exists(name):
        while error.__cause__ is not None:  # `datasets` wraps the reader's own complaint (the line, the column)
            error = error.__cause__
        problem = f"could not be read: {type(error).__name__}: {' '.join(str(error).split())[:400]}"
        fix = "Fix the file (one JSON object per line for `.jsonl`), or pass another one."
    elif constants.HF_HUB_OFFLINE:
        problem = "is not in the local datasets cache, and the Hub cannot be used here"
        fix = (f"Pass a local JSON, JSONL or Parquet file with `--dataset_name path/to/train.jsonl`, or download it "
               f"where the Hub is reachable (`hf download --repo-type dataset {name}`).")  # fmt: skip
    else:
        return None
    return InputError([InputProblem("dataset_name", name, problem, fix, local=True)])


def program_name() -> str:
    """The running program's name for messages: `train_dpo` for `launch/train_dpo.py`, `safe-trainers` for the CLI."""
    base = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "safe_trainers"
    return os.path.splitext(base)[0] or "safe_trainers"


def is_local_main() -> bool:
    """Whether this is the first process on its machine (or the only one): the one that prints for the others."""
    return os.environ.get("LOCAL_RANK", "0") in ("0", "-1")


def say_once(line: str) -> None:
    if is_local_main():
        print(line, file=sys.stderr, flush=True)


__all__ = ["check_argv", "check_config_keys", "check_data", "check_settings", "hub_names", "load_error",
           "program_name", "settings_problems"]  # fmt: skip
