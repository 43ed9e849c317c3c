"""Apply the changes of fixed findings: to a `TrainerSetup` before construction, to a built trainer after it.

These are the only functions that act on what the rules decided. The user's own objects are never mutated: a changed
config is a new config (`dataclasses.replace`, so its `__post_init__` validates and derives fields again), a changed
PEFT config is a copy.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from .report import REMOVED, Change, Finding
from .setup import TrainerSetup


def apply_to_setup(setup: TrainerSetup, finding: Finding) -> TrainerSetup:
    """A new `TrainerSetup` with the finding's changes applied."""
    arg_changes = [c for c in finding.changes if c.path.startswith("args.")]
    updates: dict[str, Any] = {}
    if arg_changes:
        args, ds = replace_args(setup.args, arg_changes, setup.deepspeed_config)
        updates.update(args=args, deepspeed_config=ds)
    for change in finding.changes:
        if change.path.startswith("peft_config."):
            peft_config = copy.copy(updates.get("peft_config", setup.peft_config))
            setattr(peft_config, change.path.removeprefix("peft_config."), change.new)
            updates["peft_config"] = peft_config
        elif change.path in ("model.attn_implementation", "ref_model.attn_implementation"):
            owner = setup.model if change.path.startswith("model.") else setup.ref_model
            owner.set_attn_implementation(change.new)
        elif not change.path.startswith("args."):
            raise ValueError(f"No way to apply a change to `{change.path}` before construction.")
    return dataclasses.replace(setup, **updates) if updates else setup


def replace_args(args: Any, changes: list[Change], deepspeed_config: dict | None) -> tuple[Any, dict | None]:
    """A copy of `args` with the changes applied (nested `model_init_kwargs.*` and `deepspeed.*` paths included)."""
    fields: dict[str, Any] = {}
    ds = copy.deepcopy(deepspeed_config) if deepspeed_config is not None else None
    for change in changes:
        name, _, rest = change.path.removeprefix("args.").partition(".")
        if name == "model_init_kwargs":
            kwargs = fields.setdefault("model_init_kwargs", dict(args.model_init_kwargs or {}))
            _set(kwargs, rest, change.new)
        elif name == "deepspeed":
            if ds is None:
                raise ValueError("A change targets the DeepSpeed config, but `args.deepspeed` is not set.")
            _set_nested(ds, rest.split("."), change.new)
            fields["deepspeed"] = ds
        else:
            fields[name] = change.new
    # A field that `__post_init__` derives from another must be reset, or the copy sees both as set by the user
    # (GRPO: `steps_per_generation` is derived from `generation_batch_size`, and setting both is rejected).
    for derived, source in _DERIVED_FIELDS.items():
        if getattr(args, derived, None) is not None and getattr(args, source, None) is not None:
            fields.setdefault(derived, None)
    return dataclasses.replace(args, **fields), ds


_DERIVED_FIELDS = {"steps_per_generation": "generation_batch_size"}


def apply_to_trainer(trainer: Any, finding: Finding) -> Any:
    """Apply the finding's changes to a constructed trainer in place and return it."""
    for change in finding.changes:
        if change.path == "model.trainable_params.dtype":
            names = set(finding.data["names"])
            for name, param in trainer.model.named_parameters():
                if name in names:
                    param.data = param.data.to(torch.float32)
        elif change.path == "train_dataset.num_rows":
            drop = set(finding.data["drop_rows"])
            keep = [i for i in range(len(trainer.train_dataset)) if i not in drop]
            trainer.train_dataset = trainer.train_dataset.select(keep)
        else:
            raise ValueError(f"No way to apply a change to `{change.path}` after construction.")
    return trainer


def _set(mapping: dict, key: str, value: Any) -> None:
    if value is REMOVED:
        mapping.pop(key, None)
    else:
        mapping[key] = value


def _set_nested(mapping: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        mapping = mapping.setdefault(key, {})
    _set(mapping, keys[-1], value)
