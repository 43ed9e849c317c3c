"""GRPO/RLOO rules (`grpo.*`): groups big enough for a baseline, batches of whole groups, sampling temperature > 0;
sample only ids the tokenizer knows; keep vLLM's importance-sampling correction unbiased."""

from __future__ import annotations

import math

from .report import Change, Finding
from .base import Rule
from .tokens import text_tokenizer


ONLINE_RL = frozenset({"grpo", "rloo"})


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


# Where `GRPOConfig`/`RLOOConfig` record the group values they checked in `__post_init__`, so that neither the rule nor
# a copy of the config (`rules.apply.copy_config`) checks them again; a value changed since is checked again.
CHECKED_GROUP = "_safety_checked_group"


def group_values(args) -> tuple[int | None, int | None, float]:
    """`(num_generations, generation_batch_size, temperature)` of a config, as `group_size_problems` takes them."""
    return (
        getattr(args, "num_generations", None),
        getattr(args, "generation_batch_size", None),
        getattr(args, "temperature", 1.0),
    )


def group_checked(args) -> bool:
    """Whether `args` checked its current group values itself (a safe GRPO/RLOO config does, once per config)."""
    return getattr(args, CHECKED_GROUP, None) == group_values(args)


class GroupSize(Rule):
    """`num_generations` >= 2, generation batch divisible by it, `temperature` > 0 (checked before loading).

    What it changes:
        blocked unless `num_generations` >= 2, the generation batch (`per_device_train_batch_size` x processes x
        `steps_per_generation`) is divisible by it, and `temperature` > 0; checked in `GRPOConfig`/`RLOOConfig`, and
        at construction, before any model is loaded, for values the config did not check (a plain TRL config, or a
        field changed after the config was built).

    Why:
        the std of one completion (GRPO) and the leave-one-out mean of none (RLOO) are NaN; a split group breaks reward
        normalisation; temperature 0 divides logits by zero.

    Opt out:
        `safety_disable_rules=["grpo.group_size"]`.
    """

    id = "grpo.group_size"
    summary = "`num_generations` >= 2, generation batch divisible by it, `temperature` > 0 (checked before loading)."
    trainers = ONLINE_RL
    rationale = "https://github.com/huggingface/trl/issues/2906"

    def check(self, setup) -> Finding | None:
        if group_checked(setup.args):
            return None  # the config checked these values when it was built (`GRPOConfig`/`RLOOConfig`)
        problems = group_size_problems(*group_values(setup.args))
        return self.blocked(" ".join(problems)) if problems else None


def padded_vocab_ids(vocab_size: int | None, tokenizer_size: int | None) -> range:
    """Ids the model can sample but the tokenizer cannot decode (`config.vocab_size` padded past the tokenizer)."""
    if not vocab_size or not tokenizer_size or tokenizer_size >= vocab_size:
        return range(0)
    return range(tokenizer_size, vocab_size)


class VocabSize(Rule):
    """A model vocabulary padded past the tokenizer: transformers generation suppresses the extra ids; vLLM warned.

    What it changes:
        a model `vocab_size` larger than the tokenizer (Qwen: 151936 vs 151665): transformers generation suppresses the
        extra ids (`generation_kwargs["suppress_tokens"]`); with vLLM, warned.

    Why:
        sampled ids past the tokenizer decode to nothing: garbage completions and rewards, or crashes
        ([verl#1398](https://github.com/volcengine/verl/issues/1398))

    Opt out:
        `safety_disable_rules=["grpo.vocab_size"]`.
    """

    id = "grpo.vocab_size"
    summary = "A model vocabulary padded past the tokenizer: transformers generation suppresses the extra ids; vLLM warned."
    trainers = ONLINE_RL
    rationale = "https://github.com/volcengine/verl/issues/1398"

    def check(self, setup) -> Finding | None:
        config = setup.text_config
        if setup.tokenizer is None or config is None:
            return None
        size = len(text_tokenizer(setup.tokenizer))
        extra = padded_vocab_ids(getattr(config, "vocab_size", None), size)
        if not extra:
            return None
        args = setup.args
        what = (
            f"the model's `vocab_size={config.vocab_size}` is larger than the tokenizer ({size} tokens), so sampling "
            f"can draw one of the {len(extra)} ids {extra.start}..{extra.stop - 1} that decode to nothing: garbage "
            "completions, wrong rewards, or a crash in decoding"
        )
        if getattr(args, "use_vllm", False):
            return self.warned(
                f"{what}. vLLM samples from the model's full vocabulary; use a vLLM that masks ids past the tokenizer, "
                "or generate with transformers (`use_vllm=False`), where this rule suppresses them."
            )
        kwargs = dict(getattr(args, "generation_kwargs", None) or {})
        kept = list(kwargs.get("suppress_tokens") or [])
        image_token = getattr(setup.model_config, "image_token_id", None)
        if image_token is not None and image_token not in kept:
            kept.append(image_token)  # TRL suppresses it for processors; `generation_kwargs` would override that
        new = {**kwargs, "suppress_tokens": kept + [i for i in extra if i not in kept]}
        return self.fixed(
            f"{what}. Generation now suppresses them (`generation_kwargs['suppress_tokens']`).",
            Change("args.generation_kwargs", getattr(args, "generation_kwargs", None), new),
        )


def truncated_sampling(args) -> list[str]:
    """The sampling settings that truncate the distribution (`top_p` < 1, `top_k` > 0, `min_p` > 0), as set; values
    in `generation_kwargs` override the fields, as TRL applies them."""
    values = {name: getattr(args, name, None) for name in ("top_p", "top_k", "min_p")}
    values.update({k: v for k, v in (getattr(args, "generation_kwargs", None) or {}).items() if k in values})
    found = []
    if values["top_p"] is not None and values["top_p"] < 1:
        found.append(f"`top_p={values['top_p']}`")
    if values["top_k"] is not None and values["top_k"] > 0:
        found.append(f"`top_k={values['top_k']}`")
    if values["min_p"] is not None and values["min_p"] > 0:
        found.append(f"`min_p={values['min_p']}`")
    return found


class VllmIsTruncation(Rule):
    """vLLM importance-sampling correction with `top_p`/`top_k`/`min_p` truncation (biased ratio): warned.

    What it changes:
        `vllm_importance_sampling_correction=True` with `top_p` < 1, `top_k` > 0 or `min_p` > 0 (fields or
        `generation_kwargs`) is warned.

    Why:
        vLLM's log-probs are renormalised over the truncated support, the trainer's over the full softmax: the
        importance ratio is biased by the kept mass ([trl#6789](https://github.com/huggingface/trl/issues/6789))

    Opt out:
        `safety_disable_rules=["grpo.vllm_is_truncation"]`.
    """

    id = "grpo.vllm_is_truncation"
    summary = "vLLM importance-sampling correction with `top_p`/`top_k`/`min_p` truncation (biased ratio): warned."
    trainers = ONLINE_RL
    rationale = "https://github.com/huggingface/trl/issues/6789"

    def check(self, setup) -> Finding | None:
        args = setup.args
        if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False)):
            return None
        truncation = truncated_sampling(args)
        if not truncation:
            return None
        return self.warned(
            f"`vllm_importance_sampling_correction=True` with {' and '.join(truncation)}: vLLM's log-probs are "
            "renormalised over the truncated support while the trainer's are over the full softmax, so every "
            "importance ratio carries the log of the kept probability mass: a biased correction that masks or "
            "clips good samples. Sample without truncation (`top_p=1.0`, `top_k=0`, `min_p=None`), or set "
            "`vllm_importance_sampling_correction=False`."
        )
