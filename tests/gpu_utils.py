"""Helpers for the GPU proof (tests/gpu): what a run logged, what a stock run did, which saved tensors are finite."""

from __future__ import annotations

import glob
import math
import os
from typing import Any

import torch
from safetensors.torch import load_file


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
