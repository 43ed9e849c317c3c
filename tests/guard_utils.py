"""Helpers for the NaN guard tests: checkpoints on disk, bad rewards, and a trainer that records its batches. Trainers
are built with `safe_trainers.testing.build.build_trainer(..., preset="guarded")`."""

from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file


def nonfinite_in_checkpoints(output_dir: str) -> list[str]:
    """Every tensor file of every checkpoint under `output_dir` that holds a NaN or Inf (empty when all clean)."""
    bad = []
    for path in glob.glob(os.path.join(output_dir, "**", "*.safetensors"), recursive=True):
        if any(t.is_floating_point() and not torch.isfinite(t).all() for t in load_file(path).values()):
            bad.append(path)
    for path in glob.glob(os.path.join(output_dir, "**", "optimizer.pt"), recursive=True):
        state = torch.load(path, weights_only=False)
        tensors = [v for s in state["state"].values() for v in s.values() if torch.is_tensor(v)]
        if any(t.is_floating_point() and not torch.isfinite(t).all() for t in tensors):
            bad.append(path)
    for pattern in ("pytorch_model_fsdp*.bin", "optimizer*.bin"):  # FSDP's FULL_STATE_DICT checkpoints
        for path in glob.glob(os.path.join(output_dir, "**", pattern), recursive=True):
            if not all_finite_nested(torch.load(path, weights_only=False)):
                bad.append(path)
    for path in glob.glob(os.path.join(output_dir, "**", "*.distcp"), recursive=True):
        directory = os.path.dirname(path)
        if directory not in bad and not all_finite_dcp(directory):
            bad.append(directory)
    return bad


def all_finite_dcp(directory: str) -> bool:
    """Whether a torch distributed checkpoint (FSDP's `SHARDED_STATE_DICT`: `pytorch_model_fsdp_0/`,
    `optimizer_0/`) holds only finite tensors, gathered whole on the host with torch's format utilities."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gathered.pt")
        dcp_to_torch_save(directory, path)
        return all_finite_nested(torch.load(path, weights_only=False), where=directory)


def all_finite_nested(state, where: str = "") -> bool:
    """Whether every floating tensor in a nested structure of dicts and lists is finite (at least one tensor)."""
    tensors = []
    stack = [state]
    while stack:
        node = stack.pop()
        if torch.is_tensor(node):
            tensors.append(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    assert tensors, f"no tensor in {where}"
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def checkpoint_steps(output_dir: str) -> list[int]:
    return sorted(int(p.rsplit("-", 1)[1]) for p in glob.glob(os.path.join(output_dir, "checkpoint-*")))


def weights_finite(trainer) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def bad_reward_at_step(step: int, value, first_only: bool):
    """A GRPO/RLOO reward function that returns `value` at optimizer step `step` (for every completion, or the first
    only), and a finite reward otherwise."""

    def reward(completions, trainer_state=None, **kwargs):
        rewards = [float(len(c)) / 10 for c in completions]
        if trainer_state.global_step + 1 == step:
            rewards = [value] + rewards[1:] if first_only else [value] * len(completions)
        return rewards

    return reward


def _digest(value, h) -> None:
    if torch.is_tensor(value):
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(value, dict) or hasattr(value, "items") and not isinstance(value, (str, bytes)):
        for key in sorted(value):
            h.update(str(key).encode())
            _digest(value[key], h)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _digest(v, h)
    else:
        h.update(repr(value).encode())


def batch_hash(inputs) -> str:
    """A stable fingerprint of one micro-batch as the dataloader delivered it."""
    import hashlib

    h = hashlib.sha1()
    _digest(inputs, h)
    return h.hexdigest()[:16]


_RECORDING: dict[type, type] = {}


def recording(trainer_cls: type) -> type:
    """`trainer_cls` with `seen`: the `(optimizer step, batch fingerprint)` of every micro-batch it trained on."""
    if trainer_cls not in _RECORDING:

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.seen = getattr(self, "seen", [])
            self.seen.append((self.state.global_step + 1, batch_hash(inputs)))
            return super(cls, self).training_step(model, inputs, num_items_in_batch)

        cls = type(f"Recording{trainer_cls.__name__}", (trainer_cls,), {"training_step": training_step})
        _RECORDING[trainer_cls] = cls
    return _RECORDING[trainer_cls]


def read_json(path: str):
    import json

    with open(path) as f:
        return json.load(f)


def fault_schedules(max_step: int, max_repeat: int, values: tuple[float, ...] = (float("nan"),)):
    """A hypothesis strategy: 1-3 [`Fault`]s of each kind the injector knows at steps 1..`max_step`, each repeated up to
    `max_repeat` steps, with one of `values`."""
    from hypothesis import strategies as st_

    from safe_trainers.testing.faults import Fault

    fault = st_.builds(
        Fault,
        step=st_.integers(1, max_step),
        kind=st_.sampled_from(["loss", "grad", "weight", "update"]),
        value=st_.sampled_from(values),
        repeat=st_.integers(1, max_repeat),
    )
    return st_.lists(fault, min_size=1, max_size=3)
