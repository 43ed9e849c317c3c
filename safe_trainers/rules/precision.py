"""Precision rules: no fp16 anywhere it can overflow (flags, accelerate, DeepSpeed, load dtype, weights passed in), and
no trainable parameter left in fp16."""

from __future__ import annotations


from .report import REMOVED, Change, Finding
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
DTYPE_NAMES = {
    "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32", "torch.float32": "float32",
}  # fmt: skip
# TRL loads a model path in float32 when `model_init_kwargs` names no dtype (`trl.trainer.utils.create_model_from_path`).
TRL_DEFAULT_LOAD_DTYPE = "float32"


def dtype_name(value: object) -> str | None:
    """`"float16"`, `"bfloat16"`, `"float32"`, `"auto"` for a dtype as `from_pretrained` accepts it; `None` otherwise."""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":  # no torch import: `str` is "torch.x"
        value = str(value)
    if isinstance(value, str):
        return "auto" if value == "auto" else DTYPE_NAMES.get(value.lower())
    return None


def is_fp16(dtype: object) -> bool:
    """Whether a `dtype` value (a `torch.dtype` or a string as accepted by `from_pretrained`) means float16."""
    return dtype_name(dtype) == "float16"


def requested_dtype(model_init_kwargs: dict) -> tuple[str, object] | None:
    """The `(key, value)` of the load dtype in `model_init_kwargs` (`dtype`, or the deprecated `torch_dtype`)."""
    for key in ("dtype", "torch_dtype"):
        if key in model_init_kwargs:
            return key, model_init_kwargs[key]
    return None


def checkpoint_dtype(model_config) -> str | None:
    """The dtype a checkpoint is stored in (`config.json`'s `dtype`/`torch_dtype`), as a name; `None` if unknown."""
    for config in (model_config, getattr(model_config, "text_config", None)):
        for key in ("dtype", "torch_dtype"):
            name = dtype_name(getattr(config, key, None)) if config is not None else None
            if name is not None and name != "auto":
                return name
    return None


def load_dtype(model_init_kwargs: dict, model_config) -> tuple[str | None, str | None]:
    """`(requested, resolved)` load dtype names for a model path: `"auto"` (and `None`) resolve to the checkpoint's
    own dtype; no request resolves to TRL's default, float32."""
    request = requested_dtype(model_init_kwargs)
    if request is None:
        return None, TRL_DEFAULT_LOAD_DTYPE
    name = dtype_name(request[1]) if request[1] is not None else "auto"
    return name, checkpoint_dtype(model_config) if name == "auto" else name


def dtype_changes(model_init_kwargs: dict, new: str) -> list[Change]:
    """Changes that set the load dtype to `new`, renaming the deprecated `torch_dtype` key to `dtype`."""
    key, old = requested_dtype(model_init_kwargs) or ("dtype", REMOVED)
    changes = [Change("args.model_init_kwargs.dtype", old if key == "dtype" else REMOVED, new)]
    if key == "torch_dtype":
        changes.append(Change("args.model_init_kwargs.torch_dtype", old, REMOVED))
    return changes


def parameter_dtypes(model) -> set[str]:
    """The floating dtypes of a model instance's parameters, as names (`set()` for a path or no model)."""
    if model is None or isinstance(model, str) or not hasattr(model, "parameters"):
        return set()
    return {dtype_name(p.dtype) or str(p.dtype) for p in model.parameters() if p.is_floating_point()}


def launcher_precision(args) -> str | None:
    """The mixed precision accelerate chose outside the config (`accelerate launch --mixed_precision`, its config
    file, or `ACCELERATE_MIXED_PRECISION`), as `args.mixed_precision` resolved it; `None` when the flags decide."""
    resolved = getattr(args, "mixed_precision", "no")
    if args.fp16 or args.bf16 or resolved in (None, "no"):
        return None
    return resolved


def fp16_sources(setup) -> list[tuple[str, str]]:
    """Where fp16 comes from, as `(kind, how the user asked for it)`: `flag`, `launcher`, `deepspeed` (the AMP side);
    `load` (a path's load dtype, requested or resolved by `"auto"`), `model`, `ref_model` (weights passed in)."""
    args = setup.args
    sources = []
    if args.fp16:
        sources.append(("flag", "`fp16=True`"))
    if launcher_precision(args) == "fp16":
        how = "`accelerate launch --mixed_precision fp16`, its config file or `ACCELERATE_MIXED_PRECISION`"
        sources.append(("launcher", f"accelerate's `mixed_precision='fp16'` ({how})"))
    if ((setup.deepspeed_config or {}).get("fp16") or {}).get("enabled") is True:
        sources.append(("deepspeed", 'DeepSpeed `"fp16": {"enabled": true}`'))
    if setup.model_is_path:
        mik = setup.model_init_kwargs
        requested, resolved = load_dtype(mik, setup.model_config)
        if resolved == "float16":
            key, value = requested_dtype(mik)
            stored = " loads the checkpoint, stored in float16," if requested == "auto" else ""
            sources.append(("load", f"`model_init_kwargs[{key!r}]={value!r}`{stored}"))
    elif "float16" in parameter_dtypes(setup.model):
        sources.append(("model", "the model passed in has fp16 weights"))
    if "float16" in parameter_dtypes(setup.ref_model):
        sources.append(("ref_model", "the `ref_model` passed in has fp16 weights"))
    return sources


class PreferBf16(Rule):
    """fp16 (flag, accelerate, DeepSpeed, load dtype, weights passed in) becomes bf16; fp32 for overflowing families
    without bf16.

    What it changes:
        fp16 from any source becomes bf16 where the hardware has bf16 (on a machine without GPU also `use_cpu=True`,
        which transformers requires for bf16): `fp16=True`; accelerate's `mixed_precision` (`accelerate launch
        --mixed_precision fp16`, its config file, `ACCELERATE_MIXED_PRECISION`) as `args.mixed_precision` resolved it;
        a DeepSpeed `"fp16": {"enabled": true}`; an fp16 load dtype, or `dtype="auto"` on a checkpoint stored in fp16;
        a model or `ref_model` instance with fp16 weights (cast before TRL builds the reference model from the policy's
        dtype). Without bf16, families that overflow fp16 (Gemma 1/2/3/3n/4, gpt-oss, Qwen3.5, Qwen3-MoE, GLM-4-MoE,
        T5) train in fp32, others keep fp16 with a warning.

    Why:
        fp16 overflows (max 65504): Gemma-3 DPO in fp16 gives reward NaN, loss 0
        ([trl#3236](https://github.com/huggingface/trl/issues/3236)); fp16 flags and fp16 weights must agree with a
        bf16 run.

    Opt out:
        `safety_disable_rules=["precision.bf16_over_fp16"]`.
    """

    id = "precision.bf16_over_fp16"
    summary = "fp16 (flag, accelerate, DeepSpeed, load dtype, weights passed in) becomes bf16; fp32 for overflowing families without bf16."  # noqa: E501
    rationale = "https://github.com/huggingface/trl/issues/3236"

    def check(self, setup) -> Finding | None:
        sources = fp16_sources(setup)
        if not sources:
            return None
        args, hw = setup.args, setup.hardware
        kinds = {kind for kind, _ in sources}
        asked = " and ".join(text for _, text in sources)
        overflow = sorted(setup.model_types & FP16_OVERFLOW_FAMILIES)
        ds = setup.deepspeed_config or {}
        if hw.bf16_supported:
            target, amp = "bfloat16", "bf16"
        elif overflow:
            target, amp = "float32", "no"
        else:
            return self.warned(
                f"{asked} kept: this device has no bf16. fp16 can overflow; keep `max_grad_norm` set and watch the "
                "NaN guard's events."
            )
        changes = []
        if kinds & {"flag", "deepspeed", "launcher"}:
            changes += [Change("args.fp16", args.fp16, False), Change("args.bf16", args.bf16, amp == "bf16")]
            if "launcher" in kinds:
                changes.append(Change("args.mixed_precision", "fp16", amp))
            if amp == "bf16" and hw.accelerator == "cpu" and not args.use_cpu:
                # transformers only accepts bf16 on a machine without a GPU when `use_cpu=True`.
                changes.append(Change("args.use_cpu", False, True))
        if "deepspeed" in kinds:
            changes.append(Change("args.deepspeed.fp16.enabled", True, False))
            if amp == "bf16":
                changes.append(Change("args.deepspeed.bf16.enabled", (ds.get("bf16") or {}).get("enabled", REMOVED), True))
        if "load" in kinds:
            changes += dtype_changes(setup.model_init_kwargs, target)
        for owner in ("model", "ref_model"):
            if owner in kinds:
                changes.append(Change(f"{owner}.dtype", "float16", target))
        if amp == "bf16":
            why = (
                f"`{overflow[0]}` activations overflow fp16's range (max 65504) and train to NaN"
                if overflow
                else "fp16 overflows without loss scaling and pure-fp16 weights break AdamW; bf16 has fp32's range"
            )
            return self.fixed(f"{asked} switched to bf16: {why}.", *changes)
        return self.fixed(
            f"{asked} switched to fp32: this device has no bf16 and `{overflow[0]}` activations overflow fp16 (NaN "
            "loss). Expect fp32 speed and about twice the memory.",
            *changes,
        )


class Fp32TrainableParams(Rule):
    """Trainable parameters stored in fp16 are upcast to fp32 (AdamW in pure fp16 gives inf/NaN).

    What it changes:
        *(built)* trainable parameters stored in fp16 are upcast to fp32.

    Why:
        AdamW in pure fp16: `eps` rounds to 0 and second moments underflow, inf/NaN on step 1.

    Opt out:
        `safety_disable_rules=["precision.fp32_trainable_params"]`.
    """

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

    def apply_built(self, trainer, finding: Finding) -> None:
        upcast_to_fp32(trainer.model, finding.data["names"])


def fp16_trainable_parameters(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and dtype_name(p.dtype) == "float16"]


def upcast_to_fp32(model, names: list[str]) -> None:
    """Upcast the parameters of `model` named in `names` to fp32, in place (the action of the fixes above)."""
    names = set(names)
    for name, param in model.named_parameters():
        if name in names:
            param.data = param.data.float()


def bf16_requests(setup) -> list[str]:
    """Where bf16 is asked for: the flag, accelerate, DeepSpeed's section, or the load dtype of a path."""
    args = setup.args
    found = ["`bf16=True`"] if args.bf16 else []
    if launcher_precision(args) == "bf16":
        found.append("accelerate's `mixed_precision='bf16'`")
    if ((setup.deepspeed_config or {}).get("bf16") or {}).get("enabled") is True:
        found.append('DeepSpeed `"bf16": {"enabled": true}`')
    if setup.model_is_path and load_dtype(setup.model_init_kwargs, setup.model_config)[0] == "bfloat16":
        found.append("`model_init_kwargs['dtype']='bfloat16'`")
    return found


class Bf16Supported(Rule):
    """bf16 asked for on a GPU without bf16 hardware (before Ampere: emulated, several times slower): warned.

    What it changes:
        bf16 asked for (`bf16=True`, accelerate, DeepSpeed, a bf16 load dtype) on a GPU without bf16 hardware (compute
        capability < 8.0: V100, T4) is warned, with fp32 or fp16 mixed precision (not for overflowing families) as the
        way out.

    Why:
        torch emulates bf16 there, several times slower; not a crash, so not changed.

    Opt out:
        `safety_disable_rules=["precision.bf16_supported"]`.
    """

    id = "precision.bf16_supported"
    summary = "bf16 asked for on a GPU without bf16 hardware (before Ampere: emulated, several times slower): warned."
    rationale = "https://github.com/axolotl-ai-cloud/axolotl/blob/main/src/axolotl/utils/schemas/config.py"

    def check(self, setup) -> Finding | None:
        hw = setup.hardware
        requests = bf16_requests(setup)
        if hw.bf16_supported or hw.accelerator != "cuda" or not requests:
            return None
        overflow = sorted(setup.model_types & FP16_OVERFLOW_FAMILIES)
        alternative = (
            f"fp32 (`bf16=False`): `{overflow[0]}` overflows fp16"
            if overflow
            else "fp16 mixed precision (`fp16=True`, `bf16=False`; weights stay fp32), or fp32 (`bf16=False`)"
        )
        return self.warned(
            f"{' and '.join(requests)} on {hw.device_name or 'this GPU'}, which has no bf16 hardware (compute "
            f"capability < 8.0): torch emulates bf16, so training runs several times slower. Use {alternative}."
        )
