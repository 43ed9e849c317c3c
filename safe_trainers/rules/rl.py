"""Online RL rules (GRPO, RLOO): sample only ids the tokenizer knows, keep vLLM's importance-sampling correction
unbiased, and say when a MoE router loss is added to the RL loss."""

from __future__ import annotations

from ..report import Change, Finding
from .base import Rule
from .tokens import text_tokenizer


ONLINE_RL = frozenset({"grpo", "rloo"})


def padded_vocab_ids(vocab_size: int | None, tokenizer_size: int | None) -> range:
    """Ids the model can sample but the tokenizer cannot decode (`config.vocab_size` padded past the tokenizer)."""
    if not vocab_size or not tokenizer_size or tokenizer_size >= vocab_size:
        return range(0)
    return range(tokenizer_size, vocab_size)


class VocabSize(Rule):
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


class RouterAuxLoss(Rule):
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
