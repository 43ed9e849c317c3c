"""OpenRLHF rules about the model a command loads (training, serving a reward model, batch inference alike): its
precision and its attention kernel."""

from __future__ import annotations

from ..rules.attention import is_flash
from ..rules.base import Rule
from ..rules.precision import FP16_OVERFLOW_FAMILIES
from ..rules.report import REMOVED, Change, Finding
from .command import CommandView, shown
from .flags import flag_kind

OPENRLHF = frozenset({"openrlhf"})


class Bf16OverFp16(Rule):
    """OpenRLHF `--param_dtype fp16` / `--ds.param_dtype fp16` becomes bf16 (blocked for fp16-overflowing families without
    bf16).

    What it changes in the command:
        `--param_dtype fp16` / `--ds.param_dtype fp16` becomes bf16.

    Opt out:
        `safe-trainers openrlhf --safety-disable-rules precision.bf16_over_fp16 -- ...`.
    """

    id = "precision.bf16_over_fp16"
    summary = "OpenRLHF `--param_dtype fp16` / `--ds.param_dtype fp16` becomes bf16 (blocked for fp16-overflowing families without bf16)."  # noqa: E501
    trainers = OPENRLHF
    rationale = "https://github.com/huggingface/trl/issues/3236"

    def check(self, view: CommandView) -> Finding | None:
        flag = view.flag("precision")
        # Up to 0.9.1 precision is the `--bf16` switch: without it DeepSpeed trains in fp32, there is no fp16 flag.
        if flag is None or flag_kind(flag) == "bool" or view.value(flag) != "fp16":
            return None
        overflow = sorted({t for m in view.models for t in m.types} & FP16_OVERFLOW_FAMILIES)
        why = (
            f"`{overflow[0]}` activations overflow fp16's range (max 65504) and train to NaN"
            if overflow
            else "fp16 overflows past 65504 (inf/NaN loss) and leans on DeepSpeed's loss scaler; bf16 has fp32's "
            "range at the same memory cost"
        )
        if view.bf16_supported is False:
            if overflow:
                return self.blocked(
                    f"`{flag} fp16` on a GPU without bf16: {why}, and OpenRLHF {view.generation} has no fp32 option "
                    f"(`{flag}` accepts only bf16 or fp16). Train on GPUs with bf16 (Ampere or newer)."
                )
            return self.warned(f"`{flag} fp16` kept: this GPU has no bf16. {why}; keep `--max_norm` set.")
        return self.fixed(f"`{flag} fp16` switched to bf16: {why}.", Change(f"argv.{flag}", "fp16", "bf16"))


class Gemma2NoFlash(Rule):
    """OpenRLHF on soft-capped models (Gemma-2): eager attention and no sample packing (it forces flash).

    What it changes in the command:
        Gemma-2 (soft-capped): `--flash_attn` removed, or `--attn_implementation` / `--ds.attn_implementation eager`
        set (flash is the default from 0.8.10), and sample packing dropped (OpenRLHF silently forces flash attention
        back when packing is on)

    Opt out:
        `safe-trainers openrlhf --safety-disable-rules attention.gemma2_no_flash -- ...`.
    """

    id = "attention.gemma2_no_flash"
    summary = "OpenRLHF on soft-capped models (Gemma-2): eager attention and no sample packing (it forces flash)."
    trainers = OPENRLHF
    rationale = "https://github.com/OpenRLHF/OpenRLHF/issues/528"

    def check(self, view: CommandView) -> Finding | None:
        capped = [m for m in view.models if m.softcap]
        if not capped:
            return None
        model = capped[0]
        attn, packing, ring, dynamic = (view.flag(c) for c in ("attention", "packing", "ring", "dynamic_batch"))
        why = (
            f"{model.describe()} soft-caps its attention logits (`attn_logit_softcapping={model.softcap}`), and "
            "flash attention gets soft-capped attention wrong (NaN loss and gradients in training, wrong scores when "
            "serving: OpenRLHF#528, transformers#31997)"
        )
        ring_size = view.number(ring, 1) if ring else 1
        if ring_size > 1:
            return self.blocked(
                f"{shown(view, ring)} needs sample packing (`{packing}`), which OpenRLHF runs only with flash "
                f"attention, and {why}. Use `{ring} 1` (no ring attention) for this model."
            )
        changes, done = [], []
        if attn is None:
            pass
        elif flag_kind(attn) == "bool":  # <= 0.8.9: `--flash_attn` switch, eager without it
            if view.has(attn):
                changes.append(Change(f"argv.{attn}", True, REMOVED))
                done.append(f"`{attn}` removed (OpenRLHF then loads the model with eager attention)")
        else:
            raw = view.value(attn)
            requested = raw if raw is not None else "flash_attention_2"
            if is_flash(requested) or requested == "sdpa":
                changes.append(Change(f"argv.{attn}", REMOVED if raw is None else raw, "eager"))
                if raw is None:
                    done.append(f"`{attn} eager` added (without it OpenRLHF {view.generation} uses flash_attention_2)")
                else:
                    done.append(f"`{attn} {raw}` set to `eager`")
        forced = "OpenRLHF silently switches back to flash attention when packing is on"
        if view.has(packing):
            changes.append(Change(f"argv.{packing}", True, REMOVED))
            done.append(f"`{packing}` removed: {forced} (expect more padding)")
        if view.has(dynamic):
            changes.append(Change(f"argv.{dynamic}", True, REMOVED))
            done.append(f"`{dynamic}` removed: it turns packing on, and {forced}")
        if not changes:
            return None
        return self.fixed(f"{why}. " + "; ".join(done) + ".", *changes)
