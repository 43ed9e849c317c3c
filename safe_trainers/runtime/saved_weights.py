"""What of a model's state dict its `save_pretrained` writes: a background save copies that part to host memory and
no more (`trainer/checkpoints.py`), and `memory.save_copy_fits` sizes the copy by it.

For a PEFT model (`PeftModel.save_pretrained`) that is the adapters and the modules saved beside them
(`modules_to_save`, resized embeddings), as PEFT's own `get_peft_model_state_dict` picks them for each adapter: a LoRA
checkpoint of a 7B model is tens of megabytes, not the 14 GB of the frozen base model. The entries are found by
identity in what PEFT picks from the state dict it is given, so the names and the values handed to
`save_pretrained` are the ones it would have picked itself.

A PEFT method that computes what it saves from the live model (prefix, prompt and p-tuning: PEFT's
`get_prompt_embedding_to_save` runs the prompt encoder whatever state dict it is given) has no part that a host copy
can stand for: [`written_part`] answers `None`, and such a model's weights are written on the training thread.
"""

from __future__ import annotations

from typing import Any

from peft import PeftModel, get_peft_model_state_dict


def written_part(model: Any, state_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The entries of `state_dict` (the model's) that `model.save_pretrained(state_dict=...)` writes, or `None` when
    what it writes is computed from the live model (a prompt-learning PEFT method), not read from `state_dict`."""
    if not isinstance(model, PeftModel):
        return state_dict
    if any(config.is_prompt_learning for config in model.peft_config.values()):
        return None
    picked: dict[int, Any] = {}
    for adapter in model.peft_config:
        chosen = get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=adapter)
        picked.update((id(value), value) for value in chosen.values())
    part = {name: value for name, value in state_dict.items() if id(value) in picked}
    return part if len({id(value) for value in part.values()}) == len(picked) else None


def written_bytes(model: Any) -> int:
    """The bytes of `model`'s weights a background save copies to host memory: what `save_pretrained` writes (tied
    weights, which share memory, once), or 0 where the weights are written on the training thread ([`written_part`]
    is `None`)."""
    part = written_part(model, model.state_dict())
    tensors = {(t.data_ptr(), t.numel(), t.dtype): t for t in (part or {}).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


__all__ = ["written_bytes", "written_part"]
