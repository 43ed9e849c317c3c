"""Generation rules (`generation.*`): settings under which GRPO/RLOO generation is so slow that the run looks hung.

Nothing crashes or goes non-finite, so these rules warn and change nothing: the slow setting can be the only one that
fits in memory.
"""

from __future__ import annotations

from .base import Rule
from .grpo import ONLINE_RL
from .report import Finding


def zero3_stage(deepspeed_config: dict | None, plugin=None) -> bool:
    """Whether the run shards its parameters with DeepSpeed ZeRO stage 3: by its `deepspeed` config, or by the
    DeepSpeed plugin `accelerate launch --use_deepspeed` gives the config (`args.deepspeed_plugin`)."""
    stage = ((deepspeed_config or {}).get("zero_optimization") or {}).get("stage")
    return str(stage) == "3" or str(getattr(plugin, "zero_stage", None)) == "3"


def sharded_generation(args) -> bool:
    """Whether TRL generates with transformers on the ZeRO-3-sharded policy: `ds3_gather_for_generation=False` without
    vLLM (vLLM holds its own full copy of the weights; the setting does not apply to it)."""
    return getattr(args, "ds3_gather_for_generation", True) is False and not getattr(args, "use_vllm", False)


class Ds3Gather(Rule):
    """GRPO/RLOO under ZeRO-3 with `ds3_gather_for_generation=False` (all-gathers per decoded token): warned.

    What it changes:
        nothing; GRPO/RLOO under DeepSpeed ZeRO-3 (a `deepspeed` config with `"stage": 3`, or `accelerate launch`'s
        DeepSpeed plugin at stage 3) with `ds3_gather_for_generation=False` and transformers generation (no
        `use_vllm`) is warned, with what it costs and the faster settings.

    Why:
        generation then runs on the sharded policy: each decoded token's forward pass all-gathers every layer's weights
        across the ranks, `max_completion_length` times per generation batch, so the first step can take hours and
        the run looks hung ([trl#3858](https://github.com/huggingface/trl/issues/3858)). The setting exists for a
        policy too large for one GPU, so it is not changed.

    Opt out:
        `safety_disable_rules=["generation.ds3_gather"]`.
    """

    id = "generation.ds3_gather"
    summary = "GRPO/RLOO under ZeRO-3 with `ds3_gather_for_generation=False` (all-gathers per decoded token): warned."
    trainers = ONLINE_RL
    rationale = "https://github.com/huggingface/trl/issues/3858"

    def check(self, setup) -> Finding | None:
        args = setup.args
        zero3 = zero3_stage(setup.deepspeed_config, getattr(args, "deepspeed_plugin", None))
        if not (zero3 and sharded_generation(args)):
            return None
        return self.warned(self.message(args))

    @staticmethod
    def message(args) -> str:
        length = getattr(args, "max_completion_length", None)
        return (
            "`ds3_gather_for_generation=False` under DeepSpeed ZeRO-3: generation runs on the sharded policy, so "
            f"every decoded token all-gathers the weights of every layer across the ranks ({length} tokens per "
            "completion, one after the other): generation slows by orders of magnitude and the first step can take "
            "hours, which looks like a hang (trl#3858). It only pays off when the policy does not fit on one GPU. If "
            "it fits, set `ds3_gather_for_generation=True` (TRL's default: the weights are gathered once per "
            'generation batch); if it does not, generate with vLLM (`use_vllm=True, vllm_mode="colocate"`) or '
            "shorten `max_completion_length`."
        )
