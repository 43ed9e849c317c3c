"""Helpers for the GPU proof (tests/gpu): what a run logged, what a stock run did, which saved tensors are finite."""

from __future__ import annotations

import glob
import math
import os
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import TrainerCallback


def logged(trainer, key: str) -> list[float]:
    """The values of `key` in the per-step logs (not in the end-of-training summary)."""
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


def all_finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def stock_outcome(trainer) -> dict[str, Any]:
    """Train a stock TRL trainer whose failure is not deterministic on every GPU and software stack, and say what it
    did: its logged losses and gradient norms, or the error it raised."""
    try:
        trainer.train()
    except Exception as error:  # recorded, not asserted: the stock side only documents the failure
        return {"raised": f"{type(error).__name__}: {error}"[:500]}
    return {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}


def record(record_property, name: str, value: Any) -> None:
    """Keep what a stock run did in the test report (`record_property`) and in the captured output (`-rP`)."""
    record_property(name, value)
    print(f"{name}: {value}")


def _tensors(value: Any):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def tensor_files(root: str) -> list[str]:
    """Every weight and optimizer file under `root`: safetensors, and the `.bin` files FSDP writes (the model
    `pytorch_model_fsdp*.bin`, the optimizer `optimizer*.bin`)."""
    patterns = ("*.safetensors", "pytorch_model_fsdp*.bin", "optimizer*.bin", "optimizer.pt")
    return sorted(p for pattern in patterns for p in glob.glob(os.path.join(root, "**", pattern), recursive=True))


def nonfinite_files(paths: list[str]) -> list[str]:
    """The files among `paths` that hold a NaN or Inf in a floating tensor."""
    bad = []
    for path in paths:
        if path.endswith(".safetensors"):
            tensors = load_file(path).values()
        else:
            tensors = _tensors(torch.load(path, map_location="cpu", weights_only=False))
        if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors):
            bad.append(path)
    return bad


class StepStates(TrainerCallback):
    """Keeps, on the device (no host read during training), the trainable weights and the optimizer's step counts
    before and after every optimizer step, and the loss scaler's scale when a `scaler` is given; compare them once
    training is done."""

    def __init__(self, scaler: Any = None):
        self.scaler = scaler
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def _state(self, model, optimizer) -> dict[str, torch.Tensor]:
        inner = getattr(optimizer, "optimizer", optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        out = {f"weight{i}": p.detach().clone() for i, p in enumerate(params)}
        counts = {i: inner.state[p]["step"] for i, p in enumerate(params) if p in inner.state}
        out |= {f"step{i}": torch.as_tensor(count).clone() for i, count in counts.items()}
        if self.scaler is not None and self.scaler._scale is not None:  # created by the first `scale()`
            out["scale"] = self.scaler._scale.clone()
        return out

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.before[state.global_step + 1] = self._state(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.after[state.global_step] = self._state(model, optimizer)

    def unchanged(self, step: int) -> bool:
        """Whether step `step` left every trainable weight and every optimizer step count as they were."""
        before, after = self.before[step], self.after[step]
        return all(torch.equal(before[k], after[k]) for k in before if k != "scale")

    def applied(self, step: int) -> bool:
        """Whether step `step` changed the weights and advanced every optimizer step count by one."""
        before, after = self.before[step], self.after[step]
        weights = any(not torch.equal(before[k], after[k]) for k in before if k.startswith("weight"))
        counts = [k for k in before if k.startswith("step")]
        return weights and bool(counts) and all(int(after[k]) == int(before[k]) + 1 for k in counts)

    def scale_factor(self, step: int) -> float:
        """The loss scale after step `step` over the scale before it."""
        return float(self.after[step]["scale"] / self.before[step]["scale"])
