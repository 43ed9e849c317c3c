"""Group rule (GRPO, RLOO): groups big enough for a baseline, batches of whole groups, sampling temperature > 0."""

from __future__ import annotations

import math

from ..report import Finding
from .base import Rule


def group_size_problems(num_generations: int | None, generation_batch_size: int | None, temperature: float) -> list[str]:
    """Messages for every invalid GRPO group setting (empty if all are valid). Pure: used by the rule and the config."""
    problems = []
    if num_generations is not None and num_generations < 2:
        problems.append(
            f"`num_generations={num_generations}`: GRPO normalises each reward by its group's standard deviation and "
            "RLOO's baseline is the mean of the other completions of the group; for a single completion both are NaN "
            "(every advantage would be 0 or NaN). Set `num_generations` to 2 or more (8 or 16 is typical)."
        )
    if (
        num_generations is not None
        and num_generations >= 2
        and generation_batch_size is not None
        and generation_batch_size % num_generations != 0
    ):
        lower = generation_batch_size - generation_batch_size % num_generations
        upper = lower + num_generations
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        problems.append(
            f"`generation_batch_size={generation_batch_size}` (per-device batch x processes x "
            f"`steps_per_generation`) is not divisible by `num_generations={num_generations}`, so a group would be "
            f"split across batches. Make it a multiple of {num_generations}, e.g. {hint}, through "
            "`per_device_train_batch_size`, `gradient_accumulation_steps` or `generation_batch_size`."
        )
    if temperature is None or not math.isfinite(temperature) or temperature <= 0:
        problems.append(
            f"`temperature={temperature}`: sampling needs a positive temperature (0 divides the logits by zero and "
            "makes every completion in a group identical). Use a value in (0, 2], e.g. 1.0."
        )
    return problems


class GroupSize(Rule):
    id = "grpo.group_size"
    summary = "`num_generations` >= 2, generation batch divisible by it, `temperature` > 0 (checked before loading)."
    trainers = frozenset({"grpo", "rloo"})
    rationale = "https://github.com/huggingface/trl/issues/2906"

    def check(self, setup) -> Finding | None:
        args = setup.args
        problems = group_size_problems(
            getattr(args, "num_generations", None),
            getattr(args, "generation_batch_size", None),
            getattr(args, "temperature", 1.0),
        )
        return self.blocked(" ".join(problems)) if problems else None
