"""The input checks of the launch scripts and `safe-trainers check`: one table of setting -> check -> fix.

Each row judges one setting at the earliest stage where it can be judged, as a pure function of the value given and
the facts observed about this machine ([`~safe_trainers.scripts.places`], [`~safe_trainers.scripts.hub`]):

- `"argv"`: the command line, before it is parsed (the `--config` file);
- `"settings"`: the parsed settings, before any model or dataset is loaded (`learning_rate`, the model, the dataset);
- `"data"`: the loaded dataset, before the model is loaded (its rows and columns).

A problem names the setting, the value received and the fix. The launch scripts print every problem of a stage as one
message and exit with status 2 (`scripts.entry`); `safe-trainers check` fails with exit 2 on a problem with a value,
and notes a problem with what this machine holds (`Row.local`: a path, the cache, the Hub), since it lints a run that
may train elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..redact import hide_in_text, shown
from .argv import config_path, join_negative_values, normalize_argv, resume_target  # the command line, re-exported
from .hub import HubAccess
from .places import DATA_FILE_EXTENSIONS, ConfigFile, Place


Stage = Literal["argv", "settings", "data"]
Verdict = tuple[str, str] | None  # (what is wrong, the fix), or None when the value is fine


@dataclass(frozen=True)
class DataShape:
    """A loaded split, as the data checks see it: `kind` (the trainer kind), the split name, its row count and columns,
    and the SFT text column (`dataset_text_field`)."""

    kind: str
    split: str
    rows: int | None
    columns: tuple[str, ...]
    text_field: str = "text"


@dataclass(frozen=True)
class Facts:
    """What the checks read besides the values: the `--config` file, the model and dataset places, the Hub decision
    and the loaded split. `None` where a stage has not observed it."""

    config: ConfigFile | None = None
    model: Place | None = None
    dataset: Place | None = None
    hub: HubAccess | None = None
    data: DataShape | None = None
    checkpoint: Place | None = None
    deepspeed: ConfigFile | None = None


@dataclass(frozen=True)
class InputProblem:
    """One setting that cannot work as given.

    Args:
        setting (`str`): the setting's name, as on the command line without `--`.
        value (`Any`): the value received (a credential's is shown as `<hidden>`, see [`~safe_trainers.redact`]).
        problem (`str`): what is wrong, completing "`setting=value` ...".
        fix (`str`): what to do instead.
        local (`bool`): the problem is about what this machine holds, not about the value (`check` notes it).
    """

    setting: str
    value: Any
    problem: str
    fix: str
    local: bool = False

    @property
    def message(self) -> str:
        return f"`{self.setting}={shown(self.setting, self.value)}` {hide_in_text(self.problem)}. {self.fix}"


class InputError(ValueError):
    """The input cannot run: every problem found at one stage, in one message. A `ValueError`, as TRL's parser raises
    for a bad setting. `problems` is empty when the message comes from a parser or a config class."""

    def __init__(self, problems: Sequence[InputProblem] = (), text: str | None = None):
        self.problems = tuple(problems)
        super().__init__(text if text is not None else render(self.problems))


def render(problems: Sequence[InputProblem]) -> str:
    """One message for `problems`: the problem itself when there is one, a count and one line each otherwise."""
    if len(problems) == 1:
        return problems[0].message
    return f"{len(problems)} settings need a fix:\n" + "\n".join(f"  - {p.message}" for p in problems)


@dataclass(frozen=True)
class Row:
    """One input check: `setting` is judged at `stage` by `judge(value, facts)`; `local` as in [`InputProblem`]."""

    setting: str
    stage: Stage
    judge: Callable[[Any, Facts], Verdict]
    local: bool = False
    doc: str = field(default="", compare=False)


def _config_file(path: str, facts: Facts) -> Verdict:
    config = facts.config
    if config is None or config.state == "mapping":
        return None
    example = "Pass a YAML file of settings, e.g. `--config configs/trainers/dpo.yaml`"
    return {
        "missing": ("names no file (looked from the current directory)", f"Check the path. {example}."),
        "directory": ("is a directory, not a YAML file", f"{example}."),
        "not_mapping": ("does not hold a mapping of settings (`name: value` lines)", f"{example}."),
        "accelerate": ("is an accelerate config, not the trainer's settings",
                       f"Give it to the launcher, `accelerate launch --config_file {path} launch/...`. {example}."),
        "deepspeed": ("is a DeepSpeed config, not the trainer's settings",
                      f"Pass it as `--deepspeed {path}`. {example}."),
        "unreadable": (f"could not be read as YAML: {config.error}", "Fix the line named above."),
    }[config.state]


def _deepspeed_file(path: str, facts: Facts) -> Verdict:
    found = facts.deepspeed
    if found is None or found.state in ("mapping", "deepspeed"):
        return None
    return {"missing": "names no file (looked from the current directory)", "directory": "is a directory, not a file",
            "unreadable": f"could not be read as JSON: {found.error}", "not_mapping": "does not hold a JSON object",
            "accelerate": "is an accelerate config, not a DeepSpeed config"}[found.state], (
        "Pass a DeepSpeed JSON file, e.g. `--deepspeed configs/deepspeed/zero2.json`.")  # fmt: skip


def _learning_rate(value: float, facts: Facts) -> Verdict:
    if value is None or (math.isfinite(value) and value >= 0):
        return None
    problem = "is negative" if math.isfinite(value) else "is not a finite number"
    return problem, "Pass a positive step size, e.g. `--learning_rate 1e-5` (or `--learning_rate=1e-5`)."


def _positive_count(what: str, example: str) -> Callable[[Any, Facts], Verdict]:
    """A judge of a count that must be at least 1: `what` it counts, and an `example` flag with a good value."""
    return lambda value, facts: None if value is None or value >= 1 else (
        f"is not a positive number of {what}", f"Pass 1 or more, e.g. `{example}`.")  # fmt: skip


def _nothing_at(place: Place, fix: str) -> tuple[str, str]:
    if place.unexpanded_home:  # `~/x` in a YAML file or a quoted flag: nothing expands it, the loaders neither
        return "starts with `~`, which is not expanded in a `--config` file or a quoted value", (
            f"Write the full path, `{place.absolute}`.")  # fmt: skip
    return f"does not exist (nothing at {place.absolute})", fix


def _checkpoint(value: str | bool | None, facts: Facts) -> Verdict:
    place = facts.checkpoint
    if not isinstance(resume_target(value), str) or place is None or place.kind == "dir":
        return None
    what = "nothing at" if place.kind == "missing" else "a file at"
    fix = "Point it at a `checkpoint-<step>` folder the trainer wrote, or pass `--resume_from_checkpoint true` for"
    return f"is not a checkpoint directory ({what} {place.absolute})", f"{fix} the newest one in `output_dir`."


def _offline(facts: Facts) -> bool:
    return facts.hub is not None and not facts.hub.online


def _model(name: str | None, facts: Facts) -> Verdict:
    place = facts.model
    if not name or place is None:
        return None
    saved = "the directory `save_pretrained` wrote (it holds `config.json` and the weights)"
    if place.kind == "dir":
        lacks = place.model_lacks
        return lacks and (f"is a directory without {lacks} ({place.absolute})", f"Point it at {saved}.")
    if place.kind == "file":
        return f"is a file ({place.absolute}), not a model directory", f"Point it at {saved}."
    if not place.hub_id:
        return _nothing_at(place, f"Check the path, or point it at {saved}.")
    if place.cached:
        return None
    if _offline(facts):
        return (
            f"is not a local directory (nothing at {place.absolute}) nor in the local Hugging Face cache, and the Hub "
            "cannot be used here",
            f"Point it at {saved}, or run `hf download {name}` where the Hub is reachable and copy "
            "`~/.cache/huggingface/hub` here.",
        )
    if place.on_hub is False:
        return (
            f"is not a local directory (nothing at {place.absolute}) nor a model on the Hugging Face Hub",
            f"Check the spelling, or point it at {saved}; for a private or gated model, log in with `hf auth login`.",
        )
    return None


def _dataset(name: str | None, facts: Facts) -> Verdict:
    place = facts.dataset
    if not name or place is None:
        return None
    formats = "a JSON, JSONL or Parquet file, or a `save_to_disk` folder"
    if place.kind == "dir":
        return None
    if place.kind == "file":
        if not place.absolute.lower().endswith(DATA_FILE_EXTENSIONS):
            return f"is a file of a type the launch scripts do not read ({place.absolute})", f"Pass {formats}."
        if place.empty:
            return f"is an empty file ({place.absolute})", "Put the training examples in it, one JSON object per line."
        return None
    if not place.hub_id:
        return _nothing_at(place, f"Check the path; pass {formats}, or a Hub dataset id.")
    if place.cached or not _offline(facts):
        return None
    return (
        f"is not a local file or folder (nothing at {place.absolute}) nor in the local cache, and the Hub cannot be "
        "used here",
        f"Pass {formats} (`--dataset_name path/to/train.jsonl`), or run `hf download --repo-type dataset {name}` "
        "where the Hub is reachable and copy `~/.cache/huggingface/hub` here.",
    )


# The columns each trainer reads from a raw (or pre-tokenized) dataset: any one set is enough. `{text}` is SFT's
# `dataset_text_field`.
DATA_COLUMNS: dict[str, tuple[tuple[str, ...], ...]] = {
    "sft": (("{text}",), ("messages",), ("conversations",), ("prompt", "completion"), ("input_ids",)),
    "reward": (("chosen", "rejected"), ("chosen_ids", "rejected_ids"), ("chosen_input_ids", "rejected_input_ids")),
    "dpo": (("chosen", "rejected"),),
    "kto": (("prompt", "completion", "label"), ("chosen", "rejected")),
    "grpo": (("prompt",),),
    "rloo": (("prompt",),),
}


def column_sets(shape: DataShape) -> list[tuple[str, ...]]:
    """The column sets the trainer of `shape.kind` accepts, with SFT's text column filled in. Pure."""
    return [tuple(shape.text_field if c == "{text}" else c for c in s) for s in DATA_COLUMNS.get(shape.kind, ())]


def _rows(name: str | None, facts: Facts) -> Verdict:
    shape = facts.data
    if shape is None or shape.rows is None or shape.rows > 0:
        return None
    return f"has no rows in split {shape.split!r}", "Put the training examples in it, or name the split that has them."


def _columns(name: str | None, facts: Facts) -> Verdict:
    shape = facts.data
    if shape is None or not shape.columns:
        return None
    accepted = column_sets(shape)
    if not accepted or any(set(s) <= set(shape.columns) for s in accepted):
        return None
    wanted = " or ".join("`" + "`, `".join(s) + "`" for s in accepted)
    return (
        f"has the columns {list(shape.columns)} in split {shape.split!r}, and {shape.kind} training reads {wanted}",
        "Rename the columns (`Dataset.rename_column`) or pass a dataset in that format.",
    )


INPUT_CHECKS: tuple[Row, ...] = (
    Row("config", "argv", _config_file, doc="the YAML file exists and holds a mapping of settings"),
    Row("deepspeed", "argv", _deepspeed_file, doc="a `.json` path names a readable DeepSpeed JSON file"),
    Row("learning_rate", "settings", _learning_rate, doc="a finite number >= 0"),
    Row("per_device_train_batch_size", "settings", _positive_count("examples", "--per_device_train_batch_size 8"),
        doc="at least 1"),
    Row("gradient_accumulation_steps", "settings", _positive_count("batches", "--gradient_accumulation_steps 1"),
        doc="at least 1"),
    Row("resume_from_checkpoint", "settings", _checkpoint, local=True, doc="`true`, `false` or a checkpoint folder"),
    Row("model_name_or_path", "settings", _model, local=True,
        doc="a model directory here, or a Hub id that is cached or on a reachable Hub"),
    Row("dataset_name", "settings", _dataset, local=True,
        doc="a JSON/JSONL/Parquet file with rows, a folder, or a Hub id that is cached or on a reachable Hub"),
    Row("dataset_name", "data", _rows, doc="the split has rows"),
    Row("dataset_name", "data", _columns, doc="the split has the columns the trainer reads"),
)  # fmt: skip


def judge(stage: Stage, values: dict[str, Any], facts: Facts) -> list[InputProblem]:
    """The problems of the settings in `values` at `stage`, in table order (a setting absent from `values` is not
    judged). Pure."""
    problems = []
    for row in INPUT_CHECKS:
        if row.stage != stage or row.setting not in values:
            continue
        verdict = row.judge(values[row.setting], facts)
        if verdict is not None:
            problems.append(InputProblem(row.setting, values[row.setting], *verdict, local=row.local))
    return problems


def raise_problems(problems: Sequence[InputProblem]) -> None:
    if problems:
        raise InputError(problems)


__all__ = ["DATA_COLUMNS", "DataShape", "Facts", "INPUT_CHECKS", "InputError", "InputProblem", "Row", "column_sets",
           "config_path", "join_negative_values", "judge", "normalize_argv", "raise_problems", "render",
           "resume_target"]  # fmt: skip
