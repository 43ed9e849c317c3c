"""OpenRLHF rules about training itself: the KTO loss, gradient clipping, GRPO-style groups, and `beta`."""

from __future__ import annotations

import math

from ..rules.base import Rule
from ..rules.optim import DEFAULT_MAX_GRAD_NORM, SANE_GRAD_NORM, clipping_disabled
from ..rules.report import REMOVED, Change, Finding
from .command import CommandView, shown
from .model_rules import OPENRLHF


# Advantage estimators that compare each completion with the others of its prompt's group.
_NO_SIGNAL = "subtracts the group mean, so with one completion every advantage is 0 and nothing is learned"
GROUP_ESTIMATORS = {
    "group_norm": "divides each reward's distance from its group mean by the group's standard deviation, and the "
    "deviation of one sample is NaN",
    "rloo": "uses the mean of the other n-1 rewards as the baseline, a division by n-1 = 0",
    "reinforce_baseline": _NO_SIGNAL,
    "dr_grpo": _NO_SIGNAL,
}


class QwenNoVanillaLoss(Rule):
    """OpenRLHF KTO (<= 0.3.3) with `--vanilla_loss`: the flag is removed (empty-group mean is NaN), any model.

    What it changes in the command:
        KTO with `--vanilla_loss` (OpenRLHF <= 0.3.3), any model family: the flag is removed (its per-micro-batch means
        are NaN when a micro-batch holds only one label; the id names the seed failure, Qwen2 KTO)

    Opt out:
        `safe-trainers openrlhf --safety-disable-rules kto.qwen2_no_vanilla_loss -- ...`.
    """

    # The id names the seed failure (Qwen2 KTO, OpenRLHF#326); the NaN itself does not depend on the model family.
    id = "kto.qwen2_no_vanilla_loss"
    summary = "OpenRLHF KTO (<= 0.3.3) with `--vanilla_loss`: the flag is removed (empty-group mean is NaN), any model."
    trainers = OPENRLHF
    rationale = "https://github.com/OpenRLHF/OpenRLHF/issues/326"

    def check(self, view: CommandView) -> Finding | None:
        flag = view.flag("vanilla_loss")
        if view.entry != "train_kto" or not view.has(flag):
            return None
        model = view.models[0].describe() if view.models else "this model"
        return self.fixed(
            f"`{flag}` removed for {model}: the vanilla KTO loss averages the desirable and the undesirable "
            "log-ratios of each shuffled micro-batch separately, and a micro-batch holding only one kind makes one of "
            "those means a mean over nothing, i.e. NaN, whatever the model (seen first as the Qwen2 KTO NaN of "
            "OpenRLHF#326; the flag was deleted in v0.3.4). Without it OpenRLHF uses its KTO loss with a KL baseline "
            "from mismatched pairs.",
            Change(f"argv.{flag}", True, REMOVED),
        )


class GradClip(Rule):
    """OpenRLHF `--max_norm` (`--actor.max_norm`, `--critic.max_norm`) <= 0, inf or NaN becomes 1.0 (not with Muon).

    What it changes in the command:
        `--max_norm`, `--actor.max_norm`, `--critic.max_norm` <= 0, inf or NaN becomes 1.0 (not with `--optim muon`)

    Opt out:
        `safe-trainers openrlhf --safety-disable-rules optim.grad_clip -- ...`.
    """

    id = "optim.grad_clip"
    summary = "OpenRLHF `--max_norm` (`--actor.max_norm`, `--critic.max_norm`) <= 0, inf or NaN becomes 1.0 (not with Muon)."  # noqa: E501
    trainers = OPENRLHF
    rationale = "https://github.com/huggingface/trl/issues/1356"

    def check(self, view: CommandView) -> Finding | None:
        changes, disabled, unusual = [], [], []
        for flag in view.flags("max_norm"):
            raw = view.value(flag)
            if raw is None:
                continue  # OpenRLHF's default is 1.0
            optim = flag.replace("max_norm", "optim")
            if optim in view.flags("optim") and view.value(optim) == "muon":
                continue  # OpenRLHF asks for `max_norm=0` with Muon: clipping after its update would cancel it
            value = view.number(flag, DEFAULT_MAX_GRAD_NORM)
            if clipping_disabled(value):
                changes.append(Change(f"argv.{flag}", raw, str(DEFAULT_MAX_GRAD_NORM)))
                disabled.append(f"`{flag} {raw}`")
            elif not SANE_GRAD_NORM[0] <= value <= SANE_GRAD_NORM[1]:
                unusual.append(f"`{flag} {raw}`")
        if changes:
            return self.fixed(
                f"{' and '.join(disabled)} turn{'s' if len(disabled) == 1 else ''} gradient clipping off (DeepSpeed "
                "clips only for a finite `gradient_clipping` > 0), so one bad batch can blow up the weights. Clipping "
                f"at {DEFAULT_MAX_GRAD_NORM}, OpenRLHF's default.",
                *changes,
            )
        if unusual:
            low, high = SANE_GRAD_NORM
            return self.warned(
                f"{' and '.join(unusual)} is outside the usual range [{low}, {high}]; 1.0 (OpenRLHF's default) is the "
                "common choice for preference and RL fine-tuning."
            )
        return None


class GroupSize(Rule):
    """OpenRLHF group estimators (group_norm/GRPO, rloo, reinforce_baseline, dr_grpo) need >= 2 samples per prompt and
    temperature > 0.

    What it changes in the command:
        group estimators (`group_norm`, `rloo`, `reinforce_baseline`, `dr_grpo`) with fewer than 2 samples per prompt
        (OpenRLHF asserts 2 or more; `group_norm` would divide by a NaN std), or temperature <= 0: blocked.

    Opt out:
        `safe-trainers openrlhf --safety-disable-rules grpo.group_size -- ...`.
    """

    id = "grpo.group_size"
    summary = "OpenRLHF group estimators (group_norm/GRPO, rloo, reinforce_baseline, dr_grpo) need >= 2 samples per prompt and temperature > 0."  # noqa: E501
    trainers = OPENRLHF
    rationale = "https://github.com/huggingface/trl/issues/2906"

    def check(self, view: CommandView) -> Finding | None:
        estimator_flag = view.flag("estimator")
        if view.entry not in ("train_ppo", "train_ppo_ray") or estimator_flag is None:
            return None
        estimator = view.value(estimator_flag) or "gae"
        if estimator not in GROUP_ESTIMATORS:
            return None
        problems = []
        n_flag, t_flag = view.flag("n_samples"), view.flag("temperature")
        n = view.number(n_flag, 1) if n_flag else 1
        if n < 2:
            given = shown(view, n_flag) if view.has(n_flag) else f"`{n_flag}` left at its default 1"
            problems.append(
                f"`{estimator_flag} {estimator}` with {given}: {estimator} {GROUP_ESTIMATORS[estimator]}. Set "
                f"`{n_flag}` to 2 or more (8 or 16 is typical)."
            )
        temperature = view.number(t_flag, 1.0) if t_flag else 1.0
        if not (math.isfinite(temperature) and temperature > 0):
            problems.append(
                f"{shown(view, t_flag)}: {estimator} needs different completions within a group, and sampling "
                "needs a positive temperature (0 makes every completion of a group identical, so every advantage is 0 or "
                "NaN). Use a value in (0, 2], e.g. 1.0."
            )
        return self.blocked(" ".join(problems)) if problems else None


class KtoBatchAndLabels(Rule):
    """OpenRLHF KTO with `--micro_train_batch_size 1`: `--vanilla_loss` removed (NaN), otherwise warned.

    What it changes in the command:
        KTO micro-batch of 1: warned; with `--vanilla_loss` (NaN on every step) the flag is removed.

    Opt out:
        `safe-trainers openrlhf --safety-disable-rules kto.batch_and_labels -- ...`.
    """

    id = "kto.batch_and_labels"
    summary = "OpenRLHF KTO with `--micro_train_batch_size 1`: `--vanilla_loss` removed (NaN), otherwise warned."
    trainers = OPENRLHF
    rationale = "https://github.com/OpenRLHF/OpenRLHF/issues/326"

    def check(self, view: CommandView) -> Finding | None:
        flag = view.flag("micro_batch")
        if view.entry != "train_kto" or flag is None or view.value(flag) is None or view.number(flag, 8) >= 2:
            return None
        baseline = (
            "OpenRLHF's KTO loss estimates its KL baseline from mismatched pairs inside each micro-batch (prompt i "
            "with completion i+1); with one example the pair is the example itself, so the baseline is just its own "
            "log-ratio. Use 2 or more."
        )
        vanilla = view.flag("vanilla_loss")
        if view.has(vanilla):
            return self.fixed(
                f"`{vanilla}` removed: with {shown(view, flag)} every micro-batch holds only desirable or only "
                "undesirable examples, so the vanilla KTO loss takes a mean over nothing on every step (NaN). "
                + baseline,
                Change(f"argv.{vanilla}", True, REMOVED),
            )
        return self.warned(f"{shown(view, flag)}: {baseline}")


# OpenRLHF's IPO loss is `(logits - 1 / (2 * beta)) ** 2`: `beta=0` is a division by zero.
IPO_FLAGS = ("--ipo", "--model.ipo_enable")


class BetaPositive(Rule):
    """OpenRLHF DPO/KTO `--beta`: non-finite, or 0 with IPO, is refused; 0 or negative otherwise warned.

    What it changes in the command:
        `--beta` / `--model.beta` non-finite, or 0 with `--ipo` / `--model.ipo_enable` (division by zero): blocked; 0
        or negative otherwise: warned.

    Opt out:
        `safe-trainers openrlhf --safety-disable-rules dpo.beta_positive -- ...`.
    """

    id = "dpo.beta_positive"
    summary = "OpenRLHF DPO/KTO `--beta`: non-finite, or 0 with IPO, is refused; 0 or negative otherwise warned."
    trainers = OPENRLHF
    rationale = "https://github.com/huggingface/trl/blob/main/trl/trainer/dpo_trainer.py"

    def check(self, view: CommandView) -> Finding | None:
        flag = view.flag("beta")
        if view.entry not in ("train_dpo", "train_kto") or flag is None or view.value(flag) is None:
            return None
        beta = view.number(flag, 0.1)
        if math.isfinite(beta) and beta > 0:
            return None
        ipo = next((item.name for item in view.command.items if item.name in IPO_FLAGS), None)
        if not math.isfinite(beta):
            return self.blocked(
                f"{shown(view, flag)}: the preference loss multiplies the policy/reference log-ratio by beta, so "
                "the loss is NaN or inf from the first step. Use a positive value, e.g. 0.1 (OpenRLHF's DPO default)."
            )
        if beta == 0 and ipo and view.entry == "train_dpo":
            return self.blocked(
                f"{shown(view, flag)} with `{ipo}`: the IPO loss divides by beta (its target is `1 / (2 * beta)`), so "
                "training fails with a division by zero. Use a positive value, e.g. 0.1."
            )
        effect = (
            "the loss is a constant with no gradient and the run learns nothing"
            if beta == 0
            else "training raises the likelihood of the rejected answers"
        )
        return self.warned(
            f"{shown(view, flag)}: the preference loss multiplies the policy/reference log-ratio by beta, so "
            f"{effect}. Use a positive value, e.g. 0.1 (OpenRLHF's DPO default)."
        )
