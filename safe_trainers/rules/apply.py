"""Apply the changes of fixed findings to a `TrainerSetup`, before construction.

Before construction a change is data: its path says where it goes (`args.*`, `peft_config.*`, `model.*`), and these
functions carry it out. After construction each rule carries out its own fix ([`Rule.apply_built`], next to its
`check_built`). The user's own objects are never mutated: a changed config is a new config (its `__post_init__`
validates and derives fields again), a changed PEFT config is a copy.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from .report import REMOVED, Change, Finding
from .context import TrainerSetup
from .grpo import CHECKED_GROUP


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
        elif change.path in ("model.dtype", "ref_model.dtype"):
            owner = setup.model if change.path.startswith("model.") else setup.ref_model
            cast_parameters(owner, DTYPES[change.old], DTYPES[change.new])
        elif not change.path.startswith("args."):
            raise ValueError(f"No way to apply a change to `{change.path}` before construction.")
    return dataclasses.replace(setup, **updates) if updates else setup


def replace_args(args: Any, changes: list[Change], deepspeed_config: dict | None) -> tuple[Any, dict | None]:
    """A copy of `args` with the changes applied (nested `model_init_kwargs.*` and `deepspeed.*` paths included)."""
    fields: dict[str, Any] = {}
    derived: dict[str, Any] = {}
    init_fields = {f.name for f in dataclasses.fields(args) if f.init}
    ds = copy.deepcopy(deepspeed_config) if deepspeed_config is not None else None
    for change in changes:
        name, _, rest = change.path.removeprefix("args.").partition(".")
        if name not in init_fields and not rest:
            derived[name] = change.new  # an attribute `__post_init__` derives (`mixed_precision`): set on the copy
        elif name == "model_init_kwargs":
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
    for field_name, source in _DERIVED_FIELDS.items():
        if getattr(args, field_name, None) is not None and getattr(args, source, None) is not None:
            fields.setdefault(field_name, None)
    new = copy_config(args, **fields)
    # `__post_init__` derives `mixed_precision` from accelerate's environment and the fp16/bf16 flags: a value a rule
    # set earlier (fp32 instead of accelerate's fp16) survives later copies unless the flags themselves change.
    flags_changed = any(fields.get(flag, getattr(args, flag)) != getattr(args, flag) for flag in ("fp16", "bf16"))
    if not flags_changed and hasattr(args, "mixed_precision"):
        new.mixed_precision = args.mixed_precision
    for name, value in derived.items():
        setattr(new, name, value)
    return new, ds


def copy_config(args: Any, **changes: Any) -> Any:
    """`dataclasses.replace(args, **changes)`, keeping the record of the group check that `args` passed (see
    [`~safe_trainers.rules.grpo.group_checked`]): the copy's `__post_init__` checks the group again only if `changes`
    changed it.

    The copy shares the devices `args` set up unless `changes` touch a field they depend on (`DEVICE_FIELDS`):
    transformers' `__post_init__` reads `self.device`, which would reset accelerate's state (the user's own
    `Accelerator` included) and set it up again. A transformers that lacks one of these names (docs/design/upstream.md)
    sets the copy's devices up again, as it does."""
    new = object.__new__(type(args))
    if hasattr(args, CHECKED_GROUP):
        setattr(new, CHECKED_GROUP, getattr(args, CHECKED_GROUP))  # set first: `__init__` sets only the fields
    device_names = (DEVICE_SETUP, *DEVICE_STATE)  # the cached device and what setting it up recorded
    if all(name in vars(args) for name in device_names) and not DEVICE_FIELDS & set(changes):
        for name in device_names:  # all or none: a transformers that records others sets them up again, as it does
            vars(new)[name] = vars(args)[name]
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    new.__init__(**{**values, **changes})
    return new


_DERIVED_FIELDS = {"steps_per_generation": "generation_batch_size"}
# transformers' cached device (`TrainingArguments._setup_devices`), what it records, and the fields it is made from.
DEVICE_SETUP = "_setup_devices"
DEVICE_STATE = ("distributed_state", "_n_gpu")
DEVICE_FIELDS = frozenset({"use_cpu", "ddp_backend", "ddp_timeout", "deepspeed", "accelerator_config"})
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def cast_parameters(model: Any, old: torch.dtype, new: torch.dtype) -> None:
    """Cast the parameters of `model` stored in `old` to `new`, in place (others, e.g. fp32 LoRA weights, are kept)."""
    for param in model.parameters():
        if param.dtype == old:
            param.data = param.data.to(new)


def _set(mapping: dict, key: str, value: Any) -> None:
    if value is REMOVED:
        mapping.pop(key, None)
    else:
        mapping[key] = value


def _set_nested(mapping: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        mapping = mapping.setdefault(key, {})
    _set(mapping, keys[-1], value)
