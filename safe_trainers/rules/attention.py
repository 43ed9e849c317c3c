"""Attention rule: no flash attention (and no sdpa without soft-cap support) for soft-capped attention logits."""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from .report import Change, Finding
from .base import Rule


def is_flash(impl: object) -> bool:
    """Whether an `attn_implementation` value selects a flash-attention kernel (local or from the Hub)."""
    return isinstance(impl, str) and "flash" in impl.lower()


def flash_soft_caps(impl: object, flash_attn_version: str | None) -> bool:
    """Whether `impl` runs the installed flash-attn package at a version that soft-caps in the backward pass too
    (2.6.3 and later); hub kernels and unknown versions are not assumed to."""
    if impl != "flash_attention_2" or not flash_attn_version:
        return False
    try:
        return Version(flash_attn_version) >= Version("2.6.3")
    except InvalidVersion:
        return False


SOFTCAP_SAFE = "eager"
"""The implementation a soft-capped model is switched to. Eager applies the soft-cap in the forward and backward pass;
sdpa never does (PyTorch's kernel has no soft-cap argument), even where the installed transformers lets the model class
load with sdpa: Gemma-2 declares `_supports_sdpa = True` in transformers 5.3-5.20 and the cap is silently dropped there
(5.21 and later refuse sdpa for it)."""


class Gemma2NoFlash(Rule):
    """Models with soft-capped attention logits (Gemma-2) train with eager, not sdpa or flash (flash-attn >= 2.6.3
    soft-caps and is kept).

    What it changes:
        for models with soft-capped attention logits (`attn_logit_softcapping`, i.e. Gemma-2), `flash_attention_*`
        (except `flash_attention_2` with an installed flash-attn >= 2.6.3, which soft-caps) or `sdpa` is replaced, for
        a path (`model_init_kwargs`) or an instance (`set_attn_implementation`), and for a DPO/KTO `ref_model`.

    Why:
        flash-attn builds before 2.6.3 ignore the soft-cap in the backward pass: NaN loss
        ([OpenRLHF#528](https://github.com/OpenRLHF/OpenRLHF/issues/528)). sdpa has no soft-cap at all: transformers
        5.21 and later refuse it for Gemma-2, and 5.3-5.20 accept it and drop the cap silently, so the target is
        `eager` on every supported release.

    Opt out:
        `safety_disable_rules=["attention.gemma2_no_flash"]`.
    """

    id = "attention.gemma2_no_flash"
    summary = (
        "Models with soft-capped attention logits (Gemma-2) train with eager, not sdpa or flash "
        "(flash-attn >= 2.6.3 soft-caps and is kept)."
    )
    rationale = "https://github.com/OpenRLHF/OpenRLHF/issues/528"

    def check(self, setup) -> Finding | None:
        text_config = setup.text_config
        softcap = getattr(text_config, "attn_logit_softcapping", None) if text_config is not None else None
        if softcap is None:
            return None
        target = SOFTCAP_SAFE
        flash_ok = getattr(setup.hardware, "flash_attn_version", None)

        def unsafe(impl: object) -> bool:
            return impl != target and (impl == "sdpa" or (is_flash(impl) and not flash_soft_caps(impl, flash_ok)))

        changes = []
        if setup.model_is_path:
            requested = setup.model_init_kwargs.get("attn_implementation")
            if requested is not None and unsafe(requested):
                changes.append(Change("args.model_init_kwargs.attn_implementation", requested, target))
        else:
            current = getattr(setup.model.config, "_attn_implementation", None)
            if unsafe(current):
                changes.append(Change("model.attn_implementation", current, target))
        ref = setup.ref_model
        if ref is not None and not isinstance(ref, str):
            current = getattr(ref.config, "_attn_implementation", None)
            if unsafe(current):
                changes.append(Change("ref_model.attn_implementation", current, target))
        if not changes:
            return None
        requested = changes[0].old
        reason = (
            "flash-attn builds before 2.6.3 (and kernels of unknown version) ignore the soft-cap in the backward pass "
            f"(NaN gradients; installed flash-attn: {flash_ok or 'none'})"
            if is_flash(requested)
            else "sdpa cannot soft-cap"
        )
        return self.fixed(
            f"`attn_implementation={requested!r}` replaced by `{target!r}`: the model soft-caps attention logits "
            f"(`attn_logit_softcapping={softcap}`) and {reason}; `{target}` applies the soft-cap.",
            *changes,
        )



