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
from .context import TrainerSetup


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
    new = dataclasses.replace(args, **fields)
    # `__post_init__` derives `mixed_precision` from accelerate's environment and the fp16/bf16 flags: a value a rule
    # set earlier (fp32 instead of accelerate's fp16) survives later copies unless the flags themselves change.
    flags_changed = any(fields.get(flag, getattr(args, flag)) != getattr(args, flag) for flag in ("fp16", "bf16"))
    if not flags_changed and hasattr(args, "mixed_precision"):
        new.mixed_precision = args.mixed_precision
    for name, value in derived.items():
        setattr(new, name, value)
    return new, ds


_DERIVED_FIELDS = {"steps_per_generation": "generation_batch_size"}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def cast_parameters(model: Any, old: torch.dtype, new: torch.dtype) -> None:
    """Cast the parameters of `model` stored in `old` to `new`, in place (others, e.g. fp32 LoRA weights, are kept)."""
    for param in model.parameters():
        if param.dtype == old:
            param.data = param.data.to(new)


def apply_to_trainer(trainer: Any, finding: Finding) -> Any:
    """Apply the finding's changes to a constructed trainer in place and return it."""
    for change in finding.changes:
        action = TRAINER_ACTIONS.get(change.path)
        if action is None:
            raise ValueError(f"No way to apply a change to `{change.path}` after construction.")
        action(trainer, change, finding.data)
    return trainer


def _upcast_trainable(trainer: Any, change: Change, data: dict) -> None:
    names = set(data["names"])
    for name, param in trainer.model.named_parameters():
        if name in names:
            param.data = param.data.to(torch.float32)


def _drop_rows(trainer: Any, change: Change, data: dict) -> None:
    drop = set(data["drop_rows"])
    trainer.train_dataset = trainer.train_dataset.select([i for i in range(len(trainer.train_dataset)) if i not in drop])


def _train_modules(trainer: Any, change: Change, data: dict) -> None:
    make_modules_trainable(trainer.model, change.new)


def _mean_embedding_rows(trainer: Any, change: Change, data: dict) -> None:
    from .tokens import embedding_matrices, set_rows_to_mean

    # The reference model starts as a copy of the policy: give it the same rows, so the KL term starts at 0.
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            matrices = embedding_matrices(model)
            for name, rows in data["rows"].items():
                if name in matrices:
                    set_rows_to_mean(matrices[name], rows)


TRAINER_ACTIONS = {
    "model.trainable_params.dtype": _upcast_trainable,
    "train_dataset.num_rows": _drop_rows,
    "model.peft_config.modules_to_save": _train_modules,
    "model.embeddings.untrained_rows": _mean_embedding_rows,
}


def make_modules_trainable(model: Any, modules_to_save: list[str], adapter: str = "default") -> None:
    """Train `modules_to_save` of a PEFT model and save them with the adapter, as PEFT does for `SEQ_CLS`."""
    from peft.utils.other import set_additional_trainable_modules

    peft_config = model.peft_config[adapter]
    peft_config.modules_to_save = list(modules_to_save)
    set_additional_trainable_modules(model, peft_config, model.config, adapter)


def _set(mapping: dict, key: str, value: Any) -> None:
    if value is REMOVED:
        mapping.pop(key, None)
    else:
        mapping[key] = value


def _set_nested(mapping: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        mapping = mapping.setdefault(key, {})
    _set(mapping, keys[-1], value)
