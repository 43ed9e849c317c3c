"""MoE rule (`moe.*`): say when a router load-balancing loss is added to the RL loss."""

from __future__ import annotations

from .report import Finding
from .base import Rule
from .grpo import ONLINE_RL


class RouterAuxLoss(Rule):
    """A MoE model's router load-balancing loss that TRL adds to the RL loss: warned (`router_aux_loss_coef`).

    What it changes:
        a Mixture-of-Experts model whose router load-balancing loss TRL adds to the RL loss (the config's
        `router_aux_loss_coef` unless `router_aux_loss_coef` is set) is warned.

    Why:
        the logged loss and its gradient are no longer the policy objective alone
        ([trl#7009](https://github.com/huggingface/trl/issues/7009))

    Opt out:
        `safety_disable_rules=["moe.router_aux_loss"]`.
    """

    id = "moe.router_aux_loss"
    summary = "A MoE model's router load-balancing loss that TRL adds to the RL loss: warned (`router_aux_loss_coef`)."
    trainers = ONLINE_RL
    rationale = "https://github.com/huggingface/trl/issues/7009"

    def check(self, setup) -> Finding | None:
        config = setup.text_config
        if config is None or not hasattr(config, "output_router_logits"):
            return None
        asked = getattr(setup.args, "router_aux_loss_coef", None)
        coef = getattr(config, "router_aux_loss_coef", 0.0) if asked is None else asked
        if not coef:
            return None
        origin = f"`router_aux_loss_coef={asked}`" if asked is not None else (
            f"the model config's `router_aux_loss_coef={coef}` (TRL's default when the field is unset)"
        )  # fmt: skip
        return self.warned(
            f"{config.model_type} is a Mixture-of-Experts model: TRL adds its router load-balancing loss, weighted by "
            f"{origin}, to the RL loss, so the logged loss and its gradient are no longer the policy objective alone "
            "(and other trainers drop it silently). Set `router_aux_loss_coef=0.0` to train on the RL objective "
            "only, or keep it to balance the experts on purpose."
        )
