"""The safety rules for OpenRLHF launcher commands.

Each rule reads a [`CommandView`] (the command under one flag generation, plus its models) and returns a [`Finding`]
whose changes are `Change("argv.<flag>", old, new)`: `old=REMOVED` adds the flag, `new=REMOVED` drops it. Rules that
share a concept with a trainer rule share its id, so `--safety-disable-rules` reads the same everywhere.
"""

from __future__ import annotations

from ..rules.base import Rule
from .model_rules import Bf16OverFp16, Gemma2NoFlash
from .training_rules import GROUP_ESTIMATORS, BetaPositive, GradClip, GroupSize, KtoBatchAndLabels, QwenNoVanillaLoss


RULES: tuple[Rule, ...] = (
    QwenNoVanillaLoss(),
    Bf16OverFp16(),
    Gemma2NoFlash(),
    GradClip(),
    GroupSize(),
    KtoBatchAndLabels(),
    BetaPositive(),
)


def rule_ids() -> list[str]:
    return [rule.id for rule in RULES]


__all__ = ["GROUP_ESTIMATORS", "RULES", "rule_ids"]
