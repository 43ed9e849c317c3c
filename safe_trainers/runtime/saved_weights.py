"""What of a model's state dict its `save_pretrained` writes: a background save copies that part to host memory and
no more (`trainer/checkpoints.py`), and `memory.save_copy_fits` sizes the copy by it.

For a PEFT model (`PeftModel.save_pretrained`) that is the adapters and the modules saved beside them
(`modules_to_save`, resized embeddings), as PEFT's own `get_peft_model_state_dict` picks them for each adapter: a LoRA
checkpoint of a 7B model is tens of megabytes, not the 14 GB of the frozen base model. The entries are found by
identity in what PEFT picks from the state dict it is given, so the names and the values handed to
`save_pretrained` are the ones it would have picked itself. A PEFT method that computes what it saves (prompt
embeddings) picks values that are not entries of the state dict: then the whole state dict is kept.
"""

from __future__ import annotations

from typing import Any

from peft import PeftModel, get_peft_model_state_dict


def written_part(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The entries of `state_dict` (the model's) that `model.save_pretrained(state_dict=...)` writes."""
    if not isinstance(model, PeftModel):
        return state_dict
    picked: dict[int, Any] = {}
    for adapter in model.peft_config:
        chosen = get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=adapter)
        picked.update((id(value), value) for value in chosen.values())
    part = {name: value for name, value in state_dict.items() if id(value) in picked}
    return part if len({id(value) for value in part.values()}) == len(picked) else state_dict


def written_bytes(model: Any) -> int:
    """The bytes `save_pretrained` writes of `model`'s weights (tied weights, which share memory, once)."""
    tensors = {(t.data_ptr(), t.numel(), t.dtype): t for t in written_part(model, model.state_dict()).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


__all__ = ["written_bytes", "written_part"]
