"""The launch scripts' pipeline (`launch/train_<kind>.py`): parse, build, train, save; shared with `safe-trainers
check`.

A script is `main(kind)`: parse a YAML `--config` plus command-line overrides with TRL's parser into
`(ScriptArguments, <safe config>, ModelConfig)`, load the model path, PEFT config and training dataset, build the
`safe_trainers` trainer (the safety rules run in its constructor), train, and save.

With neither `model_name_or_path` nor `dataset_name` given, the scripts run on a tiny model and a toy dataset built
locally (no network), so `accelerate launch launch/train_dpo.py` works on a fresh machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from trl import ModelConfig, get_peft_config

from ..kinds import TrainerKind, get_kind
from ..testing import toy
from . import preflight
from .arguments import ScriptArguments, has_accelerator, make_parser, parse_args
from .data import load_checked_split, load_split, load_train_dataset
from .argv import resume_target
from .rewards import load_reward_funcs


if TYPE_CHECKING:
    from transformers import Trainer


logger = logging.getLogger("safe_trainers")

TOY_MODEL_DIRNAME = "toy-model"


def model_and_peft(kind: str, model_args: ModelConfig, training_args: Any) -> tuple[str, Any, Any]:
    """The model path, the config with `model_init_kwargs` filled from `model_args`, and the PEFT config.

    `model_init_kwargs` gets `revision`, `trust_remote_code`, `attn_implementation` and `dtype` as TRL's scripts set
    them; keys already in `training_args.model_init_kwargs` win. The PEFT config is `get_peft_config(model_args)`
    unchanged (`lora_task_type` as given): fixing it is the safety rules' job, so the fix is reported.

    Raises:
        ValueError: when `model_args.model_name_or_path` is not set.
    """
    get_kind(kind)
    if not model_args.model_name_or_path:
        raise ValueError(
            "`model_name_or_path` is not set. Pass `--model_name_or_path <hub id or local path>` (or set it in the "
            "`--config` file); leave both it and `dataset_name` unset to run on the built-in toy model and dataset."
        )
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    return model_args.model_name_or_path, training_args, get_peft_config(model_args)


def use_toy_defaults(kind: str, script_args: ScriptArguments, model_args: ModelConfig, training_args: Any) -> bool:
    """Point `model_args` at a tiny local model when neither a model nor a dataset is given; return whether it did.

    The model is built and saved to `<output_dir>/toy-model` by the local main process of each node while the other
    processes wait, so every rank loads the same weights. The toy dataset comes from [`load_split`].

    Raises:
        ValueError: when exactly one of `model_name_or_path` and `dataset_name` is set (a real model on toy data, or
            real data on a random toy model, is almost always a forgotten flag).
    """
    has_model, has_data = bool(model_args.model_name_or_path), bool(script_args.dataset_name or script_args.datasets)
    if has_model and has_data:
        return False
    if has_model != has_data:
        missing = "dataset_name" if has_model else "model_name_or_path"
        given = "model_name_or_path" if has_model else "dataset_name"
        raise ValueError(
            f"`{given}` is set but `{missing}` is not. Set `--{missing}` too, or leave both unset to run on the "
            "built-in toy model and dataset."
        )
    from accelerate import PartialState

    path = os.path.join(training_args.output_dir, TOY_MODEL_DIRNAME)
    task = get_kind(kind).model_task
    with PartialState().local_main_process_first():
        if PartialState().is_local_main_process:
            with _zero3_init_disabled():
                toy.save_toy_model(path, task=task)
    if training_args.process_index == 0:
        logger.warning(
            f"safe_trainers: no `model_name_or_path` and no `dataset_name`, so training the tiny toy model saved at "
            f"{path!r} on the toy {kind} dataset. Pass both to train your own model."
        )
    model_args.model_name_or_path = path
    return True


@contextlib.contextmanager
def _zero3_init_disabled():
    """Build a model outside DeepSpeed ZeRO-3's `zero.Init`: a ZeRO-3 config (from `--deepspeed` or an accelerate
    config) makes `from_config` partition the weights across ranks, but the toy model is built by one process."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _share_process_group_with_deepspeed(training_args: Any) -> None:
    """With `use_cpu=True`, transformers sets up a plain (gloo) process group and leaves DeepSpeed's communication
    layer uninitialised, so ZeRO-3 would partition the weights for a world of one process when the model is loaded.
    Hand the existing process group to DeepSpeed (no-op on GPUs, without DeepSpeed, or when it is already done)."""
    import torch.distributed as dist

    if not (training_args.deepspeed and training_args.use_cpu and dist.is_available() and dist.is_initialized()):
        return
    import deepspeed

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def build_trainer(kind: str, script_args: ScriptArguments, training_args: Any, model_args: ModelConfig) -> Trainer:
    """The `safe_trainers` trainer of `kind` for parsed arguments (toy defaults, model, PEFT, data, rewards)."""
    from trl import get_quantization_config

    row: TrainerKind = get_kind(kind)
    # First the reward names: one the script cannot build is refused before any data or weight is loaded.
    reward_funcs = load_reward_funcs(script_args.reward_funcs) if row.online else None
    _share_process_group_with_deepspeed(training_args)
    use_toy_defaults(kind, script_args, model_args, training_args)
    model, training_args, peft_config = model_and_peft(kind, model_args, training_args)
    kwargs: dict[str, Any] = dict(
        model=model,
        args=training_args,
        train_dataset=load_checked_split(kind, script_args, training_args, script_args.dataset_train_split),
        peft_config=peft_config,
        quantization_config=get_quantization_config(model_args),
    )
    if training_args.eval_strategy != "no":
        kwargs["eval_dataset"] = load_checked_split(kind, script_args, training_args, script_args.dataset_test_split)
    if reward_funcs is not None:
        kwargs["reward_funcs"] = reward_funcs
    from ..trainers import trainer_class

    return trainer_class(kind)(**kwargs)


def main(kind: str, argv: list[str] | None = None) -> Trainer:
    """Parse `argv`, check the input, build the `safe_trainers` trainer of `kind`, train, save to `output_dir`, and
    return the trainer.

    The process group is destroyed at the end (`trainer.end()`), so the returned trainer is for reading its state
    (`trainer.state`, `trainer.safety_report`), not for more distributed work.

    Raises:
        InputError: for a setting, model or dataset that cannot work (`scripts.inputs`), before any model is loaded.
    """
    script_args, training_args, model_args = parse_args(kind, argv)
    if get_kind(kind).online:
        preflight.check_reward_names(script_args.reward_funcs)
    preflight.check_settings(script_args, training_args, model_args)
    trainer = build_trainer(kind, script_args, training_args, model_args)
    trainer.train(resume_from_checkpoint=resume_target(training_args.resume_from_checkpoint))
    if trainer.is_fsdp_enabled:  # with sharded state dicts, transformers' `save_model` writes no model under FSDP
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"safe_trainers: model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.accelerator.wait_for_everyone()  # every rank is done before the process group goes away
    end = getattr(trainer, "end", None)  # transformers >= 5.18: finish trackers, destroy the process group
    if end is not None:
        end()
    return trainer


__all__ = [
    "ScriptArguments",
    "build_trainer",
    "has_accelerator",
    "load_split",
    "load_train_dataset",
    "main",
    "make_parser",
    "model_and_peft",
    "parse_args",
    "use_toy_defaults",
]
