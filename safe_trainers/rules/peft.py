"""PEFT rule for reward models: a LoRA reward model needs `task_type="SEQ_CLS"`, a trainable head, no fp16 weights."""

from __future__ import annotations

from ..report import Change, Finding
from .base import BuiltTrainer, Rule
from .precision import dtype_changes, fp16_trainable_parameters, is_fp16, requested_dtype


HEAD_NAMES = ("score", "classifier")


def head_parameters(model) -> dict[str, bool]:
    """`{name: requires_grad}` for every parameter of the sequence-classification head (`score` or `classifier`)."""
    return {
        name: p.requires_grad
        for name, p in model.named_parameters()
        if any(part in HEAD_NAMES for part in name.split("."))
    }


class RewardSeqClsLora(Rule):
    id = "peft.reward_seq_cls_lora"
    summary = 'LoRA reward models get `task_type="SEQ_CLS"` (head trained and saved), dtype "auto", no fp16 params.'
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
        if setup.model_is_path and load is not None and is_fp16(load[1]):
            changes += dtype_changes(setup.model_init_kwargs, "auto")
            reasons.append(
                f"`{load[0]}={load[1]!r}` makes the trained head fp16, which gives loss ~1e34 then NaN; "
                '`dtype="auto"` loads the checkpoint\'s own precision'
            )
        if not changes:
            return None
        return self.fixed("; ".join(reasons) + ".", *changes)

    def check_built(self, built: BuiltTrainer) -> Finding | None:
        if built.peft_config is None:
            return None
        head = head_parameters(built.model)
        if not head:
            return self.blocked(
                "the reward model has no `score` or `classifier` head, so PEFT cannot train one. Load the model with "
                "`AutoModelForSequenceClassification` and `num_labels=1`."
            )
        if not any(head.values()):
            return self.blocked(
                f"the reward head ({', '.join(head)}) is frozen after PEFT wrapping, so the reward stays random. Set "
                '`task_type="SEQ_CLS"` or `modules_to_save=["score"]` in the `peft_config`.'
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
