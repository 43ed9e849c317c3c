"""Preference-loss rules: a `beta` the loss can use, and a KTO micro-batch that can hold the KL term's pairs."""

from __future__ import annotations

import math

from ..report import Finding
from .base import Rule


# DPO loss types whose target margin is `1 / (2 * beta)` (IPO) or `0.5 / beta` (SPPO): `beta=0` divides by zero.
DIVIDES_BY_BETA = frozenset({"ipo", "sppo_hard"})
# Loss types that do not use `beta` at all (DPO's `sft` term: the chosen answers' NLL).
BETA_FREE_LOSSES = frozenset({"sft"})
# KTO loss types without the KL term (TRL computes it from mismatched pairs inside each micro-batch).
KTO_KL_FREE_LOSSES = frozenset({"apo_zero_unpaired"})


def loss_types(args) -> list[str]:
    """The configured loss types as a list (DPO takes a list, KTO a string)."""
    value = getattr(args, "loss_type", None)
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def beta_problem(beta: float, losses: list[str]) -> tuple[str, str] | None:
    """`(action, message)` for a `beta` the preference loss cannot use, or `None` when it is fine.

    `blocked` where training crashes or gives NaN (a non-finite `beta`; `beta=0` with a loss that divides by it),
    `warned` where it trains to nothing (`beta=0` scales every log-ratio to 0: constant loss, no gradient) or the
    wrong way (`beta < 0` prefers the rejected answers). Losses that do not read `beta` (`sft` alone) are fine.
    """
    if losses and set(losses) <= BETA_FREE_LOSSES:
        return None
    if not math.isfinite(beta):
        return "blocked", (
            f"`beta={beta}`: the preference loss multiplies every log-ratio by `beta`, so the loss is NaN or inf from "
            "the first step. Use a positive value, e.g. 0.1."
        )
    dividing = sorted(DIVIDES_BY_BETA.intersection(losses))
    if beta == 0 and dividing:
        return "blocked", (
            f"`beta=0.0` with `loss_type={dividing[0]!r}`: this loss divides by `beta` (its target margin is "
            "`1 / (2 * beta)`), so TRL fails with a division by zero. Use a positive value, e.g. 0.1."
        )
    if beta == 0:
        return "warned", (
            "`beta=0.0`: the preference loss multiplies every log-ratio by `beta`, so the loss is a constant with no "
            "gradient and the run learns nothing. Use a positive value, e.g. 0.1."
        )
    if beta < 0:
        return "warned", (
            f"`beta={beta}`: a negative `beta` flips the sign of the preference loss, so training raises the "
            "likelihood of the rejected answers. Use a positive value, e.g. 0.1."
        )
    return None


class BetaPositive(Rule):
    id = "dpo.beta_positive"
    summary = "DPO/KTO `beta`: non-finite, or 0 with a loss that divides by it (IPO, SPPO), is refused; <= 0 warned."
    trainers = frozenset({"dpo", "kto"})
    rationale = "https://github.com/huggingface/trl/blob/main/trl/trainer/dpo_trainer.py"

    def check(self, setup) -> Finding | None:
        beta = getattr(setup.args, "beta", None)
        if beta is None or isinstance(beta, bool) or not isinstance(beta, (int, float)):
            return None
        problem = beta_problem(float(beta), loss_types(setup.args))
        if problem is None:
            return None
        action, message = problem
        return self.blocked(message) if action == "blocked" else self.warned(message)


def kto_uses_kl(loss_type: str | None) -> bool:
    """Whether TRL's KTO loss of this type estimates the KL term (from mismatched pairs inside each micro-batch)."""
    return (loss_type or "kto") not in KTO_KL_FREE_LOSSES


class KtoBatchAndLabels(Rule):
    id = "kto.batch_and_labels"
    summary = "KTO with its KL term needs `per_device_train_batch_size` >= 2 (TRL refuses 1); one label kind is fine."
    trainers = frozenset({"kto"})
    rationale = "https://github.com/OpenRLHF/OpenRLHF/issues/326"

    def check(self, setup) -> Finding | None:
        # A dataset with only desirable (or only undesirable) examples trains: TRL skips the empty side of the loss
        # and averages with `nanmean`. Only a micro-batch too small for the KL pairs fails.
        args = setup.args
        batch = args.per_device_train_batch_size
        loss_type = getattr(args, "loss_type", None)
        if batch >= 2 or not kto_uses_kl(loss_type):
            return None
        return self.blocked(
            f"`per_device_train_batch_size={batch}` with `loss_type={loss_type or 'kto'!r}`: KTO estimates its KL "
            "term from mismatched pairs inside each micro-batch, which needs at least 2 examples, and TRL refuses a "
            "batch of 1. Use 2 or more (lower `gradient_accumulation_steps` to keep the effective batch), or "
            '`loss_type="apo_zero_unpaired"`, which has no KL term.'
        )
