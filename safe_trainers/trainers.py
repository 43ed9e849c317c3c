"""The four safe trainers: TRL's trainers with the safety rules and the NaN guard. Drop-in replacements."""

from __future__ import annotations

import trl

from .configs import DPOConfig, GRPOConfig, KTOConfig, RewardConfig
from .generation import OnlineGenerationMixin
from .mixin import SafeTrainerMixin


class RewardTrainer(SafeTrainerMixin, trl.RewardTrainer):
    """[`~trl.RewardTrainer`] with construction-time safety rules and the NaN guard; same arguments.

    Example:

    ```python
    from safe_trainers import RewardConfig, RewardTrainer

    trainer = RewardTrainer(model="path/to/model", args=RewardConfig(output_dir="out"), train_dataset=dataset)
    print(trainer.safety_report.render())
    ```
    """

    _safety_kind = "reward"
    _safety_config_class = RewardConfig
    _trl_class = trl.RewardTrainer


class DPOTrainer(SafeTrainerMixin, trl.DPOTrainer):
    """[`~trl.DPOTrainer`] with construction-time safety rules and the NaN guard; same arguments.

    Example:

    ```python
    from safe_trainers import DPOConfig, DPOTrainer

    trainer = DPOTrainer(model="path/to/model", args=DPOConfig(output_dir="out", fp16=True), train_dataset=dataset)
    trainer.safety_report.by_rule("precision.bf16_over_fp16")  # fp16=True -> bf16=True
    ```
    """

    _safety_kind = "dpo"
    _safety_config_class = DPOConfig
    _trl_class = trl.DPOTrainer


class KTOTrainer(SafeTrainerMixin, trl.KTOTrainer):
    """[`~trl.KTOTrainer`] with construction-time safety rules and the NaN guard; same arguments."""

    _safety_kind = "kto"
    _safety_config_class = KTOConfig
    _trl_class = trl.KTOTrainer


class GRPOTrainer(SafeTrainerMixin, OnlineGenerationMixin, trl.GRPOTrainer):
    """[`~trl.GRPOTrainer`] with construction-time safety rules and the NaN guard; same arguments."""

    _safety_kind = "grpo"
    _safety_config_class = GRPOConfig
    _trl_class = trl.GRPOTrainer
