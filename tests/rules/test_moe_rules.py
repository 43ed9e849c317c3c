"""`moe.router_aux_loss`: a MoE router's load-balancing loss added to the RL loss."""

from __future__ import annotations

import pytest
from transformers import MixtralConfig, Qwen3MoeConfig

from safe_trainers.rules import get_rule
from safe_trainers.testing.toy import model_config

from rule_utils import make_args, make_setup  # tests/ is on sys.path, as for conftest


ROUTER = get_rule("moe.router_aux_loss")


# --------------------------------------------------------------------------------------------------------------------
# moe.router_aux_loss
# --------------------------------------------------------------------------------------------------------------------


def moe_config(cls=Qwen3MoeConfig, **overrides):
    return cls(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, **overrides)  # fmt: skip


@pytest.mark.parametrize("cls", [Qwen3MoeConfig, MixtralConfig])
def test_router_aux_loss_added_to_the_rl_loss_warned(cls):
    finding = ROUTER.check(make_setup("grpo", None, config=moe_config(cls), model="toy/moe"))
    assert finding.action == "warned" and "router load-balancing loss" in finding.message
    assert "`router_aux_loss_coef=0.0`" in finding.message


@pytest.mark.parametrize(
    "config, args_kw",
    [
        (moe_config(router_aux_loss_coef=0.0), {}),
        (moe_config(), {"router_aux_loss_coef": 0.0}),  # the user turned it off
        (model_config("qwen2"), {}),  # a dense model
    ],
)
def test_router_aux_loss_silent(config, args_kw):
    setup = make_setup("grpo", None, config=config, model="toy/m", args=make_args("grpo", **args_kw))
    assert ROUTER.check(setup) is None
