"""Optimisation rules: gradient clipping on and finite, and agreeing with the DeepSpeed config."""

from __future__ import annotations

import math

from .report import REMOVED, Change, Finding
from .base import Rule


DEFAULT_MAX_GRAD_NORM = 1.0
SANE_GRAD_NORM = (0.01, 10.0)


def clipping_disabled(value: object) -> bool:
    """Whether a `max_grad_norm` value disables clipping or is not a usable number (None, <= 0, inf, NaN)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    return not math.isfinite(value) or value <= 0


class GradClip(Rule):
    """Disabled or non-finite clipping (`max_grad_norm` <= 0, None, inf, NaN) becomes 1.0; DeepSpeed agrees.

    What it changes:
        `max_grad_norm` that is `None`, <= 0, inf or NaN becomes 1.0; a numeric DeepSpeed `gradient_clipping` that
        disagrees is set to the same value; values outside [0.01, 10] are reported.

    Why:
        no clipping lets one bad batch blow up the weights ([trl#1356](https://github.com/huggingface/trl/issues/1356))

    Opt out:
        `safety_disable_rules=["optim.grad_clip"]`.
    """

    id = "optim.grad_clip"
    summary = "Disabled or non-finite clipping (`max_grad_norm` <= 0, None, inf, NaN) becomes 1.0; DeepSpeed agrees."
    rationale = "https://github.com/huggingface/trl/issues/1356"

    def check(self, setup) -> Finding | None:
        args = setup.args
        value = args.max_grad_norm
        ds = setup.deepspeed_config or {}
        ds_clip = ds.get("gradient_clipping", REMOVED)
        target = DEFAULT_MAX_GRAD_NORM if clipping_disabled(value) else value
        changes = []
        if target != value:
            changes.append(Change("args.max_grad_norm", value, target))
        if ds and ds_clip != "auto" and ds_clip != target:
            changes.append(Change("args.deepspeed.gradient_clipping", ds_clip, target))
        if changes:
            parts = []
            if target != value:
                parts.append(
                    f"`max_grad_norm={value!r}` disables gradient clipping, so one bad batch can blow up the weights"
                )
            if ds and ds_clip != "auto" and ds_clip != target:
                parts.append(f'DeepSpeed `"gradient_clipping": {ds_clip!r}` disagrees with `max_grad_norm`')
            return self.fixed("; ".join(parts) + f". Clipping at {target}.", *changes)
        low, high = SANE_GRAD_NORM
        if not low <= value <= high:
            return self.warned(
                f"`max_grad_norm={value}` is outside the usual range [{low}, {high}]: "
                + ("updates will barely move." if value < low else "clipping will almost never act.")
                + " 1.0 is the common choice for preference and RL fine-tuning."
            )
        return None


# Full fine-tuning of every weight in preference/RL training (TRL's DPO, KTO, GRPO and RLOO default to 1e-6): above
# this, the policy leaves the reference within a few steps and the loss saturates or diverges. A heuristic: warned.
FULL_FINETUNE_MAX_LR = 1e-5


def is_full_finetune(setup) -> bool:
    """No PEFT config and no PEFT model passed in: every weight is trained."""
    return setup.peft_config is None and not hasattr(setup.model, "peft_config")


class LearningRate(Rule):
    """Full fine-tuning in preference/RL training with `learning_rate` > 1e-05: warned.

    What it changes:
        full fine-tuning (no `peft_config`, no `PeftModel`) with `learning_rate` > 1e-5 is warned.

    Why:
        TRL's default is 1e-6; far above it the policy leaves the reference within a few steps and the loss saturates
        or diverges (a heuristic, so a warning)

    Opt out:
        `safety_disable_rules=["optim.learning_rate"]`.
    """

    id = "optim.learning_rate"
    summary = f"Full fine-tuning in preference/RL training with `learning_rate` > {FULL_FINETUNE_MAX_LR:g}: warned."
    trainers = frozenset({"dpo", "kto", "grpo", "rloo"})
    rationale = "https://github.com/huggingface/trl/blob/main/trl/trainer/dpo_config.py"

    def check(self, setup) -> Finding | None:
        lr = getattr(setup.args, "learning_rate", None)
        if not isinstance(lr, (int, float)) or lr <= FULL_FINETUNE_MAX_LR or not is_full_finetune(setup):
            return None
        return self.warned(
            f"`learning_rate={lr:g}` while training every weight: preference and RL fine-tuning usually runs at "
            f"1e-7 to 5e-6 (TRL's default is 1e-6), and above {FULL_FINETUNE_MAX_LR:g} the policy moves far from the "
            "reference within a few steps, so the loss saturates or diverges. Use about 1e-6, or LoRA (a "
            "`peft_config`), which tolerates 1e-5 to 1e-4."
        )
