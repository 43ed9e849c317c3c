"""The trainer kinds: one row per TRL trainer that `safe_trainers` wraps.

The mixin (default run name, model class), the launch scripts (toy model and data, reward functions),
`safe-trainers check --trainer`, the toy data and the tests read this table instead of branching on the kind. Adding
the next TRL trainer is one row here, its two classes (`configs.py`, `trainers.py`: a line each) and the kind added to
the `trainers=` set of the rules that apply to it.

This module is data: it imports nothing of the package. The safe classes are looked up where they are defined
([`~safe_trainers.configs.config_class`], [`~safe_trainers.trainers.trainer_class`]), by the names a row gives.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal


ModelTask = Literal["causal_lm", "seq_cls"]
DataFormat = Literal["prompt_completion", "preference", "unpaired", "prompt"]


@dataclass(frozen=True)
class TrainerKind:
    """One TRL trainer wrapped by `safe_trainers`.

    Args:
        id (`str`):
            Short name used in reports, in the rules' `trainers=` sets, by `safe-trainers check --trainer` and in
            `launch/train_<id>.py`.
        trl_name (`str`):
            The prefix of TRL's class names, kept by the safe classes: `"DPO"` for `DPOTrainer` and `DPOConfig`.
        run_suffix (`str`):
            With `args=None`, TRL names the default `output_dir` `"<model name>-<run_suffix>"`.
        model_task (`str`):
            `"causal_lm"` or `"seq_cls"`: the auto class TRL loads a model path with.
        data_format (`str`):
            The format of the trainer's training data (`"prompt_completion"`, `"preference"`, `"unpaired"` or
            `"prompt"`); selects the toy dataset.
        online (`bool`, *optional*, defaults to `False`):
            Whether the trainer generates its own completions and scores them with `reward_funcs` (GRPO, RLOO).
    """

    id: str
    trl_name: str
    run_suffix: str
    model_task: ModelTask
    data_format: DataFormat
    online: bool = False

    @property
    def trainer_name(self) -> str:
        return f"{self.trl_name}Trainer"

    @property
    def config_name(self) -> str:
        return f"{self.trl_name}Config"

    @property
    def trl_trainer(self) -> type:
        """TRL's trainer class, e.g. `trl.DPOTrainer`."""
        return getattr(importlib.import_module("trl"), self.trainer_name)

    @property
    def trl_config(self) -> type:
        """TRL's config class, e.g. `trl.DPOConfig`."""
        return getattr(importlib.import_module("trl"), self.config_name)


# In the order of an RLHF pipeline: supervised fine-tuning, a reward model or offline preferences, online RL.
KINDS: dict[str, TrainerKind] = {
    kind.id: kind
    for kind in (
        TrainerKind("sft", "SFT", "SFT", "causal_lm", "prompt_completion"),
        TrainerKind("reward", "Reward", "Reward", "seq_cls", "preference"),
        TrainerKind("dpo", "DPO", "DPO", "causal_lm", "preference"),
        TrainerKind("kto", "KTO", "KTO", "causal_lm", "unpaired"),
        TrainerKind("grpo", "GRPO", "GRPO", "causal_lm", "prompt", online=True),
        TrainerKind("rloo", "RLOO", "RLOO", "causal_lm", "prompt", online=True),
    )
}
TRAINER_KINDS: tuple[str, ...] = tuple(KINDS)


def get_kind(kind: str) -> TrainerKind:
    """The [`TrainerKind`] with id `kind`.

    Raises:
        ValueError: for an unknown id; the message lists the valid ones.
    """
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"Unknown trainer kind {kind!r}; choose one of {', '.join(TRAINER_KINDS)}.") from None


__all__ = ["KINDS", "TRAINER_KINDS", "TrainerKind", "get_kind"]
