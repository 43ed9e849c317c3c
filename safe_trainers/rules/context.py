"""`TrainerSetup`: the read-only view of a trainer construction that the rules inspect.

Everything a rule may look at is gathered here once, before any weight is loaded: the trainer kind, the config, the
model (a path or an instance) and its `PretrainedConfig`, the PEFT config, the training dataset, the DeepSpeed config as
a dict, the tokenizer, and the facts about the hardware and the installed libraries ([`Hardware`]: this machine, or the
target named to `safe-trainers check`). Rules read it and never modify it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..kinds import TRAINER_KINDS, get_kind  # noqa: F401 (`TRAINER_KINDS` re-exported)
from .config_data import code_not_run_note, config_as_data
from .families import family_from_name
from .hardware import Hardware

# Trainers whose construction-time rules read the tokenizer (pad token of reward models; vocabulary of online RL).
TOKENIZER_KINDS = frozenset({"reward", "grpo", "rloo"})


@dataclass(frozen=True)
class TrainerSetup:
    """What a trainer is about to be built from.

    Args:
        kind (`str`):
            The trainer kind, a key of [`~safe_trainers.kinds.KINDS`] (`"sft"`, `"reward"`, `"dpo"`, ...).
        args (`TrainingArguments`):
            The trainer config (never `None`: a default is built as TRL would).
        model (`str | PreTrainedModel`):
            A path or hub id, or an instantiated model.
        model_config (`PretrainedConfig | None`):
            The model's config, read from `config.json` for a path (no weights are loaded); `None` if unreadable.
        ref_model (`PreTrainedModel | None`):
            The reference model passed to DPO or KTO, if any.
        peft_config (`PeftConfig | None`):
            The PEFT config passed to the trainer, if any.
        train_dataset (`Dataset | IterableDataset | None`):
            The training dataset as passed (before TRL tokenizes it).
        deepspeed_config (`dict | None`):
            The DeepSpeed config, loaded from `args.deepspeed` when that is a path.
        hardware ([`Hardware`]):
            Facts about the machine.
        tokenizer (`PreTrainedTokenizerBase | ProcessorMixin | None`):
            The `processing_class` passed, else the tokenizer TRL will load from the model's directory (no weights);
            `None` if it cannot be read.
        inferred_family (`str | None`):
            The `model_type` recognised from the model's name when its `config.json` could not be read (a Hub id
            linted offline): `model_config` is then that family's default config, and the report says so.
        explicit_args (`frozenset[str] | None`):
            The config fields the user set, when that is known (`safe-trainers check` reads them from the YAML file
            and the overrides); `None` for a config object, see [`~TrainerSetup.user_set`].
        code_not_run (`bool`):
            `args.trust_remote_code` (or `model_init_kwargs`' own) is set but the model's own code was not run
            (`safe-trainers check` without `--run-model-code`): `model_config` was read as data (see
            [`~safe_trainers.rules.config_data`]).
    """

    kind: str
    args: Any
    model: Any = None
    model_config: Any = None
    ref_model: Any = None
    peft_config: Any = None
    train_dataset: Any = None
    deepspeed_config: dict | None = None
    hardware: Hardware = field(default_factory=Hardware)
    tokenizer: Any = None
    inferred_family: str | None = None
    explicit_args: frozenset[str] | None = None
    code_not_run: bool = False

    @property
    def assumptions(self) -> list[str]:
        """What the rules assumed about the model, for the report (empty when everything was read)."""
        notes = []
        if self.code_not_run:
            tokenizer_read = self.tokenizer is not None if self.kind in TOKENIZER_KINDS else None
            notes.append(code_not_run_note(None if self.inferred_family else self.model_config, tokenizer_read))
        if self.inferred_family is not None:
            notes.append(
                f"`{self.model_name}` is a `{self.inferred_family}` model, inferred from the name: its `config.json` "
                "could not be read, so the rules used that family's default config."
            )
        return notes

    def user_set(self, name: str) -> bool:
        """Whether the user set config field `name` rather than leaving the library default.

        Exact when `explicit_args` is known; for a config object (which does not record what was passed), a value
        different from the field's default counts as set, so a default that is passed explicitly counts as not set.
        """
        if self.explicit_args is not None:
            return name in self.explicit_args
        default = field_default(type(self.args), name)
        return getattr(self.args, name, default) != default

    @property
    def model_init_kwargs(self) -> dict[str, Any]:
        return dict(getattr(self.args, "model_init_kwargs", None) or {})

    @property
    def model_is_path(self) -> bool:
        return isinstance(self.model, str)

    @property
    def text_config(self) -> Any:
        if self.model_config is None:
            return None
        get = getattr(self.model_config, "get_text_config", None)
        return get() if get is not None else self.model_config

    @property
    def model_types(self) -> set[str]:
        """`model_type` of the model config and of its text sub-config (e.g. `{"gemma3", "gemma3_text"}`)."""
        return {c.model_type for c in (self.model_config, self.text_config) if c is not None}

    @property
    def model_name(self) -> str:
        if isinstance(self.model, str):
            return self.model
        name = getattr(getattr(self.model, "config", None), "_name_or_path", None)
        return name or type(self.model).__name__


def field_default(config_class: type, name: str) -> Any:
    """The default of dataclass field `name` of `config_class` (`None` when it has none or is not a field)."""
    for f in dataclasses.fields(config_class) if dataclasses.is_dataclass(config_class) else ():
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return None


def load_deepspeed_config(value: Any) -> dict | None:
    """The DeepSpeed config as a dict, from a dict, a JSON file path or a JSON string; `None` if unset."""
    if value is None or value == "":
        return None
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and os.path.isfile(value):
        with open(value) as f:
            return json.load(f)
    if isinstance(value, str) and value.lstrip().startswith("{"):
        return json.loads(value)
    return None


def read_model_config(model: Any, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """The `PretrainedConfig` of a model path or instance, without loading any weight; `None` if it can't be read."""
    if model is None:
        return None
    if not isinstance(model, str):
        return getattr(model, "config", None)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError):
        return None


def config_from_name(model: Any) -> tuple[Any, str | None]:
    """For a model path or id whose `config.json` cannot be read: the default config of the family its name says
    (see [`~safe_trainers.rules.families.family_from_name`]) and that family, or `(None, None)`."""
    family = family_from_name(model) if isinstance(model, str) else None
    if family is None:
        return None, None
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(family), family
    except ValueError:  # a family the installed transformers does not know
        return None, None


def read_tokenizer(model: Any, model_config: Any, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """The tokenizer TRL would load for `model` (from the path, or from an instance's `name_or_path`), or `None`."""
    name = model if isinstance(model, str) else getattr(model_config, "_name_or_path", None)
    if not name:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def build_setup(
    kind: str,
    args: Any,
    model: Any,
    *,
    ref_model: Any = None,
    peft_config: Any = None,
    train_dataset: Any = None,
    processing_class: Any = None,
    hardware: Hardware | None = None,
    explicit_args: frozenset[str] | None = None,
    trust_remote_code: bool | None = None,
) -> TrainerSetup:
    """Gather a [`TrainerSetup`] for `kind` from the trainer's arguments (reads `config.json` and the tokenizer files,
    loads no weight).

    `trust_remote_code=False` reads a model whose config says `trust_remote_code=True` without running its own code
    (`safe-trainers check`): `config.json` as data, the report says so. `None` (the trainers) follows `args`."""
    init_kwargs = getattr(args, "model_init_kwargs", None) or {}
    # TRL loads the model with `model_init_kwargs`' own `trust_remote_code` when it has one
    wanted = bool(getattr(args, "trust_remote_code", False) or init_kwargs.get("trust_remote_code"))
    trusted = wanted if trust_remote_code is None else trust_remote_code and wanted
    code_not_run = wanted and not trusted and isinstance(model, str)
    revision = init_kwargs.get("revision")
    model_config = read_model_config(model, trust_remote_code=trusted, revision=revision)
    if model_config is None and code_not_run:
        model_config = config_as_data(model, revision)
    inferred_family = None
    if model_config is None:
        model_config, inferred_family = config_from_name(model)
    tokenizer = processing_class
    if tokenizer is None and kind in TOKENIZER_KINDS:
        tokenizer = read_tokenizer(model, model_config, trust_remote_code=trusted, revision=revision)
    return TrainerSetup(
        kind=kind,
        args=args,
        model=model,
        model_config=model_config,
        ref_model=ref_model,
        peft_config=peft_config,
        train_dataset=train_dataset,
        deepspeed_config=load_deepspeed_config(getattr(args, "deepspeed", None)),
        hardware=hardware or Hardware.detect(),
        tokenizer=tokenizer,
        inferred_family=inferred_family,
        explicit_args=explicit_args,
        code_not_run=code_not_run,
    )


__all__ = ["Hardware", "TrainerSetup", "build_setup", "load_deepspeed_config", "read_model_config"]
