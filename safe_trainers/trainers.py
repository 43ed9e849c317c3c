"""The safe trainers: TRL's trainers with the safety rules and the NaN guard. Drop-in replacements.

Each class names its kind (a row of [`~safe_trainers.kinds.KINDS`]); the mixin takes TRL's class, the safe config
class and TRL's constructor signature from there.
"""

from __future__ import annotations

import trl

from .upstream.names import require_upstream_names


# Before the modules below import transformers' and TRL's internals by name: outside the supported versions, one
# `ImportError` that names every missing name, the installed versions and the supported ranges.
require_upstream_names()

from .trainer.generation import OnlineGenerationMixin  # noqa: E402
from .kinds import get_kind  # noqa: E402
from .trainer.mixin import SafeTrainerMixin  # noqa: E402


class SFTTrainer(SafeTrainerMixin, trl.SFTTrainer):
    """[`~trl.SFTTrainer`] with construction-time safety rules and the NaN guard; same arguments.

    Example:

    ```python
    from . import SFTConfig, SFTTrainer

    trainer = SFTTrainer(model="path/to/model", args=SFTConfig(output_dir="out"), train_dataset=dataset)
    trainer.safety_report.by_rule("data.no_loss_tokens")  # examples left with no trained token, dropped
    ```
    """

    _safety_kind = "sft"


class RewardTrainer(SafeTrainerMixin, trl.RewardTrainer):
    """[`~trl.RewardTrainer`] with construction-time safety rules and the NaN guard; same arguments.

    Example:

    ```python
    from . import RewardConfig, RewardTrainer

    trainer = RewardTrainer(model="path/to/model", args=RewardConfig(output_dir="out"), train_dataset=dataset)
    print(trainer.safety_report.render())
    ```
    """

    _safety_kind = "reward"


class DPOTrainer(SafeTrainerMixin, trl.DPOTrainer):
    """[`~trl.DPOTrainer`] with construction-time safety rules and the NaN guard; same arguments.

    Example:

    ```python
    from . import DPOConfig, DPOTrainer

    trainer = DPOTrainer(model="path/to/model", args=DPOConfig(output_dir="out", fp16=True), train_dataset=dataset)
    trainer.safety_report.by_rule("precision.bf16_over_fp16")  # fp16=True -> bf16=True
    ```
    """

    _safety_kind = "dpo"


class KTOTrainer(SafeTrainerMixin, trl.KTOTrainer):
    """[`~trl.KTOTrainer`] with construction-time safety rules and the NaN guard; same arguments."""

    _safety_kind = "kto"


class GRPOTrainer(SafeTrainerMixin, OnlineGenerationMixin, trl.GRPOTrainer):
    """[`~trl.GRPOTrainer`] with construction-time safety rules and the NaN guard; same arguments."""

    _safety_kind = "grpo"


class RLOOTrainer(SafeTrainerMixin, OnlineGenerationMixin, trl.RLOOTrainer):
    """[`~trl.RLOOTrainer`] with construction-time safety rules and the NaN guard; same arguments.

    It shares GRPO's generation code: the same group rule (`grpo.group_size`), the same reward events, and the guard
    discards the buffered rollouts after a rollback.
    """

    _safety_kind = "rloo"


def trainer_class(kind: str) -> type:
    """The safe trainer class of trainer kind `kind` (a key of [`~safe_trainers.kinds.KINDS`]), e.g. `DPOTrainer`."""
    return globals()[get_kind(kind).trainer_name]
