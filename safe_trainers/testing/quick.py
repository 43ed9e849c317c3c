"""One set of quick settings for short runs on tiny models: the tests, the demo and the bench start from these."""

from __future__ import annotations

from typing import Any


def quick_args(**overrides: Any) -> dict[str, Any]:
    """Config keyword arguments for a short, quiet run: 2 steps of batch 2 at lr 1e-3, logging every step, no saves,
    no progress bar or reports, no gradient checkpointing, on the CPU unless a GPU is present. `overrides` win.

    Example:
        ```python
        >>> from safe_trainers import DPOConfig
        >>> args = DPOConfig(**quick_args(output_dir="out", max_steps=10))
        ```
    """
    import torch

    args: dict[str, Any] = dict(
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        seed=0,
    )
    args.update(overrides)
    if not {"gradient_checkpointing", "activation_checkpointing"} & overrides.keys():
        args[checkpointing_field()] = False
    return args


def checkpointing_field() -> str:
    """The name of the activation (gradient) checkpointing switch in the installed transformers: newer releases
    call it `activation_checkpointing` and warn (FutureWarning) when `gradient_checkpointing` is set instead."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


__all__ = ["checkpointing_field", "quick_args"]
