"""Precision rules: bf16 instead of fp16, and no trainable parameter left in fp16."""

from __future__ import annotations

import torch

from ..report import REMOVED, Change, Finding
from .base import BuiltTrainer, Rule


# Families whose activations exceed fp16's range (65504): they produce NaN/Inf in fp16 and must train in bf16 or fp32.
# Gemma 1/2 (trl#1371: Gemma + fp16 DPO all NaN), Gemma 3 (trl#3236, transformers#36822), and Unsloth's
# `FORCE_FLOAT32` list (unsloth_zoo/model_lists.py), plus T5/mT5 (transformers clamps them in fp16 for this reason).
FP16_OVERFLOW_FAMILIES = frozenset(
    {
        "gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text",
        "gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "glm4_moe", "glm4_moe_lite", "t5", "mt5",
    }
)  # fmt: skip
FP16_NAMES = frozenset({"float16", "fp16", "half", "torch.float16"})


def is_fp16(dtype: object) -> bool:
    """Whether a `dtype` value (a `torch.dtype` or a string as accepted by `from_pretrained`) means float16."""
    return dtype == torch.float16 or (isinstance(dtype, str) and dtype.lower() in FP16_NAMES)


def requested_dtype(model_init_kwargs: dict) -> tuple[str, object] | None:
    """The `(key, value)` of the load dtype in `model_init_kwargs` (`dtype`, or the deprecated `torch_dtype`)."""
    for key in ("dtype", "torch_dtype"):
        if key in model_init_kwargs:
            return key, model_init_kwargs[key]
    return None


def dtype_changes(model_init_kwargs: dict, new: str) -> list[Change]:
    """Changes that set the load dtype to `new`, renaming the deprecated `torch_dtype` key to `dtype`."""
    key, old = requested_dtype(model_init_kwargs) or ("dtype", REMOVED)
    changes = [Change("args.model_init_kwargs.dtype", old if key == "dtype" else REMOVED, new)]
    if key == "torch_dtype":
        changes.append(Change("args.model_init_kwargs.torch_dtype", old, REMOVED))
    return changes


class PreferBf16(Rule):
    id = "precision.bf16_over_fp16"
    summary = "fp16 (flag, load dtype or DeepSpeed section) becomes bf16; fp32 for fp16-overflowing families without bf16."
    rationale = "https://github.com/huggingface/trl/issues/3236"

    def check(self, setup) -> Finding | None:
        args, hw = setup.args, setup.hardware
        mik = setup.model_init_kwargs
        load = requested_dtype(mik)
        fp16_load = load is not None and is_fp16(load[1])
        ds = setup.deepspeed_config or {}
        ds_fp16 = (ds.get("fp16") or {}).get("enabled") is True
        if not (args.fp16 or fp16_load or ds_fp16):
            return None

        asked = []
        if args.fp16:
            asked.append("`fp16=True`")
        if fp16_load:
            asked.append(f"`model_init_kwargs[{load[0]!r}]={load[1]!r}`")
        if ds_fp16:
            asked.append('DeepSpeed `"fp16": {"enabled": true}`')
        asked_text = " and ".join(asked)
        overflow = sorted(setup.model_types & FP16_OVERFLOW_FAMILIES)

        if hw.bf16_supported:
            changes = []
            if args.fp16 or ds_fp16:
                changes += [Change("args.fp16", args.fp16, False), Change("args.bf16", args.bf16, True)]
                if hw.accelerator == "cpu" and not args.use_cpu:
                    # transformers only accepts bf16 on a machine without a GPU when `use_cpu=True`.
                    changes.append(Change("args.use_cpu", False, True))
            if fp16_load:
                changes += dtype_changes(mik, "bfloat16")
            if ds_fp16:
                changes += [
                    Change("args.deepspeed.fp16.enabled", True, False),
                    Change("args.deepspeed.bf16.enabled", (ds.get("bf16") or {}).get("enabled", REMOVED), True),
                ]
            why = (
                f"`{overflow[0]}` activations overflow fp16's range (max 65504) and train to NaN"
                if overflow
                else "fp16 overflows without loss scaling and pure-fp16 weights break AdamW; bf16 has fp32's range"
            )
            return self.fixed(f"{asked_text} switched to bf16: {why}.", *changes)

        if overflow:
            changes = [Change("args.fp16", args.fp16, False), Change("args.bf16", args.bf16, False)]
            if fp16_load:
                changes += dtype_changes(mik, "float32")
            if ds_fp16:
                changes.append(Change("args.deepspeed.fp16.enabled", True, False))
            return self.fixed(
                f"{asked_text} switched to fp32: this device has no bf16 and `{overflow[0]}` activations overflow "
                "fp16 (NaN loss). Expect fp32 speed and about twice the memory.",
                *changes,
            )
        return self.warned(
            f"{asked_text} kept: this device has no bf16. fp16 can overflow; keep `max_grad_norm` set and watch the "
            "NaN guard's events."
        )


class Fp32TrainableParams(Rule):
    id = "precision.fp32_trainable_params"
    summary = "Trainable parameters stored in fp16 are upcast to fp32 (AdamW in pure fp16 gives inf/NaN)."
    rationale = "https://github.com/huggingface/peft/issues/1522"

    def check_built(self, built: BuiltTrainer) -> Finding | None:
        names = fp16_trainable_parameters(built.model)
        if not names:
            return None
        return self.fixed(
            f"{len(names)} trainable parameter(s) are fp16 (e.g. `{names[0]}`): AdamW's `eps=1e-8` rounds to 0 and "
            "its second moments underflow in fp16, so the first step gives inf/NaN. Upcast to fp32.",
            Change("model.trainable_params.dtype", "float16", "float32"),
            names=names,
        )


def fp16_trainable_parameters(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
