"""The safety rules, in the order they run.

Order matters where two rules touch one setting: the reward LoRA rule picks `dtype="auto"` (for a checkpoint not stored
in fp16) before the precision rule would turn the same fp16 request into bf16, and the hardware rules see the precision
the earlier rules chose. Ids are stable: never rename one, deprecate it instead; new rules are appended.
"""

from __future__ import annotations

from .attention import Gemma2NoFlash
from .base import ALL_TRAINERS, BuiltTrainer, Rule
from .data import NoLossTokens
from .dpo import BetaPositive
from .env import CublasSigfpe
from .generation import Ds3Gather
from .grpo import GroupSize, VllmIsTruncation, VocabSize
from .kto import KtoBatchAndLabels
from .logging import ShowNonFinite
from .memory import SaveCopyFits, SnapshotFits
from .moe import RouterAuxLoss
from .optim import GradClip, LearningRate
from .peft import RewardSeqClsLora
from .precision import Bf16Supported, Fp32TrainableParams, PreferBf16
from .tokens import RewardPadToken, UntrainedEmbeddings


DEFAULT_RULES: tuple[Rule, ...] = (
    RewardSeqClsLora(),
    PreferBf16(),
    Gemma2NoFlash(),
    GradClip(),
    ShowNonFinite(),
    GroupSize(),
    KtoBatchAndLabels(),
    BetaPositive(),
    NoLossTokens(),
    Fp32TrainableParams(),
    Bf16Supported(),
    CublasSigfpe(),
    LearningRate(),
    RewardPadToken(),
    UntrainedEmbeddings(),
    VocabSize(),
    VllmIsTruncation(),
    RouterAuxLoss(),
    SnapshotFits(),
    SaveCopyFits(),
    Ds3Gather(),
)


def rule_ids() -> list[str]:
    return [rule.id for rule in DEFAULT_RULES]


def get_rule(rule_id: str) -> Rule:
    for rule in DEFAULT_RULES:
        if rule.id == rule_id:
            return rule
    raise KeyError(f"Unknown rule id {rule_id!r}. Valid ids are: {', '.join(rule_ids())}.")


def check_disabled_ids(disabled: list[str]) -> None:
    """Raise a `ValueError` listing the valid ids if `safety_disable_rules` names a rule that does not exist."""
    unknown = sorted(set(disabled) - set(rule_ids()))
    if unknown:
        raise ValueError(
            f"`safety_disable_rules` contains unknown rule ids {unknown}. Valid ids are: {', '.join(rule_ids())}."
        )


__all__ = ["ALL_TRAINERS", "DEFAULT_RULES", "BuiltTrainer", "Rule", "check_disabled_ids", "get_rule", "rule_ids"]
