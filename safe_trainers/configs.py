"""Safe trainer configs: TRL's configs with the [`SafetyArguments`] fields added.

Drop-in: `from safe_trainers import DPOConfig` instead of `from trl import DPOConfig`; every TRL field keeps its name,
default and CLI flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import trl

from .arguments import SafetyArguments, validate_safety_arguments
from .errors import SafetyError
from .report import Finding
from .rules.grpo import GroupSize, group_size_problems


@dataclass
class RewardConfig(SafetyArguments, trl.RewardConfig):
    """[`~trl.RewardConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`)."""


@dataclass
class DPOConfig(SafetyArguments, trl.DPOConfig):
    """[`~trl.DPOConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`)."""


@dataclass
class KTOConfig(SafetyArguments, trl.KTOConfig):
    """[`~trl.KTOConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`)."""


@dataclass
class GRPOConfig(SafetyArguments, trl.GRPOConfig):
    """[`~trl.GRPOConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`).

    The `grpo.group_size` rule runs here too, before TRL's own checks, so an invalid group gets one error that names
    every bad setting and its fix.
    """

    def __post_init__(self):
        validate_safety_arguments(self)
        if self.safety_mode != "off" and GroupSize.id not in self.safety_disable_rules:
            explicit_batch = self.generation_batch_size  # TRL derives it later when unset
            problems = group_size_problems(self.num_generations, explicit_batch, self.temperature)
            if problems:
                raise SafetyError([Finding(GroupSize.id, "blocked", " ".join(problems))])
        super().__post_init__()


CONFIG_CLASSES: dict[str, type] = {"reward": RewardConfig, "dpo": DPOConfig, "kto": KTOConfig, "grpo": GRPOConfig}
