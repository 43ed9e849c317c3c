"""Find the first module whose output goes non-finite, by replaying a batch with forward hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _tensors(value: Any):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict) or hasattr(value, "values") and not isinstance(value, (str, bytes)):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _nonfinite(value: Any) -> bool:
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in _tensors(value))


def first_nonfinite_module(model: torch.nn.Module, replay: Callable[[], Any]) -> dict[str, Any]:
    """Run `replay()` (the training forward over the offending batch) with a forward hook on every module of `model`.

    Returns:
        `{"module": name, "type": class name}` for the first module, in execution order, whose output contains NaN
        or Inf; `{"module": None, "reason": ...}` when every module output is finite (the fault came from the loss
        computation or the gradients, not the forward pass) or when the replay itself failed.
    """
    found: dict[str, Any] = {}
    names = {module: name for name, module in model.named_modules()}

    def hook(module, inputs, output):
        if not found and _nonfinite(output):
            found.update(module=names.get(module, type(module).__name__), type=type(module).__name__)
            found["input_finite"] = not _nonfinite(inputs)

    handles = [module.register_forward_hook(hook) for module in model.modules()]
    try:
        # Grad mode on, as in the training forward that failed (some code paths differ under no_grad).
        with torch.enable_grad():
            replay()
    except Exception as error:  # the replay is diagnostic only: never let it break training
        if not found:
            return {"module": None, "reason": f"replay failed: {type(error).__name__}: {error}"[:300]}
    finally:
        for handle in handles:
            handle.remove()
    if found:
        return found
    return {"module": None, "reason": "every module output was finite; the loss or the backward pass was not"}
