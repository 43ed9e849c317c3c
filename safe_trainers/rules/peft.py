"""PEFT rule for reward models: a LoRA reward model needs a trainable, saved head and no fp16 weights."""

from __future__ import annotations

from .report import Change, Finding
from .base import BuiltTrainer, Rule
from .precision import (
    checkpoint_dtype,
    dtype_changes,
    fp16_trainable_parameters,
    is_fp16,
    requested_dtype,
    upcast_to_fp32,
)


HEAD_NAMES = ("score", "classifier")


def head_parameters(model) -> dict[str, bool]:
    """`{name: requires_grad}` for every parameter of the sequence-classification head (`score` or `classifier`)."""
    return {
        name: p.requires_grad
        for name, p in model.named_parameters()
        if any(part in HEAD_NAMES for part in name.split("."))
    }


def head_module_names(head: dict[str, bool]) -> list[str]:
    """The head module names (`score`, `classifier`) that the head parameter names contain, in order."""
    return [name for name in HEAD_NAMES if any(name in param.split(".") for param in head)]


class RewardSeqClsLora(Rule):
    """LoRA reward models get a trainable head saved with the adapter (`task_type="SEQ_CLS"`), no fp16 head.

    What it changes:
        a LoRA `peft_config` gets `task_type="SEQ_CLS"` (PEFT then trains the `score` head and saves it with the
        adapter); an fp16/`"half"` load dtype becomes `"auto"` when the checkpoint is not stored in fp16 (otherwise
        `precision.bf16_over_fp16` handles it); *(built)* a `PeftModel` passed in with a frozen head gets the head
        trained and saved with the adapter (`modules_to_save`), an fp16 trainable head is upcast to fp32, a head with
        an unknown name is warned.

    Why:
        without `SEQ_CLS` the random head stays frozen and unsaved; an fp16 head gives loss ~1e34 then NaN
        ([trl#2367](https://github.com/huggingface/trl/issues/2367),
        [peft#1522](https://github.com/huggingface/peft/issues/1522))

    Opt out:
        `safety_disable_rules=["peft.reward_seq_cls_lora"]`.
    """

    id = "peft.reward_seq_cls_lora"
    summary = 'LoRA reward models get a trainable head saved with the adapter (`task_type="SEQ_CLS"`), no fp16 head.'
    trainers = frozenset({"reward"})
    rationale = "https://github.com/huggingface/trl/issues/2367"

    def check(self, setup) -> Finding | None:
        peft_config = setup.peft_config
        if peft_config is None:
            return None
        changes = []
        reasons = []
        task_type = getattr(peft_config, "task_type", None)
        task_value = getattr(task_type, "value", task_type)
        if task_value != "SEQ_CLS":
            changes.append(Change("peft_config.task_type", task_value, "SEQ_CLS"))
            reasons.append(
                f"`task_type={task_value!r}` leaves the randomly initialised `score` head frozen and unsaved "
                '(`"SEQ_CLS"` makes PEFT train it and save it with the adapter)'
            )
        load = requested_dtype(setup.model_init_kwargs)
        stored = checkpoint_dtype(setup.model_config)
        # `"auto"` loads the checkpoint's own precision: safe only when the checkpoint is not stored in fp16 (an fp16
        # checkpoint is left to `precision.bf16_over_fp16`, which picks bf16, or fp32 without bf16 hardware).
        if setup.model_is_path and load is not None and is_fp16(load[1]) and stored is not None and not is_fp16(stored):
            changes += dtype_changes(setup.model_init_kwargs, "auto")
            reasons.append(
                f"`{load[0]}={load[1]!r}` makes the trained head fp16, which gives loss ~1e34 then NaN; "
                f'`dtype="auto"` loads the checkpoint\'s own precision (`{stored}`)'
            )
        if not changes:
            return None
        return self.fixed("; ".join(reasons) + ".", *changes)

    def check_built(self, built: BuiltTrainer) -> Finding | None:
        if built.peft_config is None:
            return None
        head = head_parameters(built.model)
        if not head:
            return self.warned(
                "the reward model has no `score` or `classifier` head, so it cannot be checked that PEFT trains and "
                "saves it. If the head has another name, add it to `modules_to_save` in the `peft_config`."
            )
        if not any(head.values()):
            modules = head_module_names(head)
            old = list(getattr(built.peft_config, "modules_to_save", None) or [])
            return self.fixed(
                f"the reward head (`{'`, `'.join(modules)}`) is frozen in the PEFT model, so the reward it outputs "
                "would stay random and would not be saved with the adapter. Made it trainable and saved with the "
                f"adapter (`modules_to_save={old + modules}`), as `task_type=\"SEQ_CLS\"` does.",
                Change("model.peft_config.modules_to_save", old or None, old + modules),
                modules_to_save=old + modules,
            )
        names = fp16_trainable_parameters(built.model)
        if names:
            return self.fixed(
                f"{len(names)} trainable parameter(s) of the LoRA reward model are fp16 (e.g. `{names[0]}`); "
                "upcast to fp32 so AdamW does not produce inf/NaN.",
                Change("model.trainable_params.dtype", "float16", "float32"),
                names=names,
            )
        return None

    def apply_built(self, trainer, finding: Finding) -> None:
        # one of the two fixes above: the frozen head (`modules_to_save`), or the fp16 trainable parameters (`names`)
        if "modules_to_save" in finding.data:
            make_modules_trainable(trainer.model, finding.data["modules_to_save"])
        else:
            upcast_to_fp32(trainer.model, finding.data["names"])


def make_modules_trainable(model, modules_to_save: list[str], adapter: str = "default") -> None:
    """Train `modules_to_save` of a PEFT model and save them with the adapter, as PEFT does for `SEQ_CLS`."""
    from peft.utils.other import set_additional_trainable_modules

    peft_config = model.peft_config[adapter]
    peft_config.modules_to_save = list(modules_to_save)
    set_additional_trainable_modules(model, peft_config, model.config, adapter)
