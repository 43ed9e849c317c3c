"""DPO rule (`dpo.*`): a `beta` the preference loss can use (also read by KTO, whose loss scales by it too)."""

from __future__ import annotations

import math

from .report import Finding
from .base import Rule


# DPO loss types whose target margin is `1 / (2 * beta)` (IPO) or `0.5 / beta` (SPPO): `beta=0` divides by zero.
DIVIDES_BY_BETA = frozenset({"ipo", "sppo_hard"})
# Loss types that do not use `beta` at all (DPO's `sft` term: the chosen answers' NLL).
BETA_FREE_LOSSES = frozenset({"sft"})
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
    """DPO/KTO `beta`: non-finite, or 0 with a loss that divides by it (IPO, SPPO), is refused; <= 0 warned.

    What it changes:
        blocked for a non-finite `beta`, or `beta=0` with `loss_type` `ipo` or `sppo_hard`; `beta=0` or negative
        otherwise is warned.

    Why:
        the loss multiplies every log-ratio by `beta` (0: constant loss, no gradient; < 0: trains toward the rejected
        answers), and IPO/SPPO divide by it.

    Opt out:
        `safety_disable_rules=["dpo.beta_positive"]`.
    """

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
