"""Frozen parameters: checked for NaN/Inf like the rest of the state, never copied into the snapshot.

The optimizer never changes a frozen parameter (a LoRA base is most of the model), so the snapshot does not hold one.
If one is ever found non-finite (written by a callback, a faulty kernel or device), a restore puts it back from where
it came from: the newest verified checkpoint of this run that holds it, else the model's own files. A file's tensor
is used only if it equals every value of the damaged parameter that is still finite, and at least half of them are:
weights changed in memory after loading (a merged adapter, resized embeddings) are never replaced by different values
from disk. What cannot be restored that way stops the run with a [`TrainingDivergedError`] naming it.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable

import torch

from ..errors import TrainingDivergedError
from .finite import all_finite, flat_chunks
from .sharding import local

logger = logging.getLogger("safe_trainers")

PEFT_PREFIX = "base_model.model."
# PEFT wraps the module that holds a base weight (`q_proj.base_layer.weight`, `score.original_module.weight`); the
# model's files name it without the wrapper.
WRAPPER_SEGMENTS = ("base_layer", "original_module")


def file_keys(name: str) -> list[str]:
    """The names a parameter may have in a safetensors file: its own, then without PEFT's prefix and wrappers."""
    bare = ".".join(part for part in name.removeprefix(PEFT_PREFIX).split(".") if part not in WRAPPER_SEGMENTS)
    return [name] if bare == name else [name, bare]


def source_matches(equal_finite: int, finite: int, numel: int) -> bool:
    """Whether a file's tensor is the damaged parameter's source: it equals all of the parameter's `finite` values
    (`equal_finite` of them are equal), and those are at least half of its `numel` values."""
    return equal_finite == finite and 2 * finite >= numel


def damaged_frozen(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The frozen parameters of `model` holding NaN or Inf (one host read when none does)."""
    frozen = [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
    if not frozen or bool(all_finite(p for _, p in frozen)):
        return []
    return [(name, p) for name, p in frozen if not bool(all_finite([p]))]


def repair_frozen(model: torch.nn.Module, checkpoints: Iterable[str], step: int) -> list[str]:
    """Restore every damaged frozen parameter of `model` from the newest of `checkpoints` that holds a matching
    tensor, else from the model's files; return the names restored.

    Raises:
        [`TrainingDivergedError`]: some damaged frozen parameter has no matching source.
    """
    damaged = damaged_frozen(model)
    if not damaged:
        return []
    model_dir = model_files(model)
    sources = [path for path in reversed(list(checkpoints)) if os.path.isdir(path)]
    sources += [model_dir] if model_dir else []
    indexes = {path: SafetensorsIndex(path) for path in sources}
    restored, left = [], []
    for name, param in damaged:
        source = next((path for path in sources if indexes[path].restore(name, param)), None)
        (restored if source else left).append(name)
        if source:
            logger.warning(f"NaN guard: the frozen parameter `{name}` was non-finite; restored it from {source}.")
    if left:
        names = ", ".join(f"`{n}`" for n in left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
        where = f"the model's files ({model_dir})" if model_dir else "the model's files (no local copy found)"
        raise TrainingDivergedError(
            f"Training stopped at step {step}: the frozen parameter(s) {names} hold NaN or Inf. The NaN guard does "
            "not copy frozen parameters (the optimizer never changes them), and neither the verified checkpoints of "
            f"this run nor {where} hold a tensor that matches their remaining finite values. Something outside "
            "training wrote to them (a callback, a faulty device): reload the model and resume from the newest "
            "checkpoint (`trainer.train(resume_from_checkpoint=...)`)."
        )
    return restored


def model_files(model: torch.nn.Module) -> str | None:
    """The local directory the model (a PEFT model's base) was loaded from, if there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
    if not path:
        return None
    if os.path.isdir(path):
        return path
    try:  # a Hub id: its snapshot in the local cache, never a download
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)
    except Exception:
        return None


class SafetensorsIndex:
    """The tensors of the safetensors files of one directory, by name (only the headers are read up front)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.files: dict[str, str] = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            try:
                with safe_open(file, framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), file))
            except Exception as error:  # an unreadable file is no source; the others may still be
                logger.warning(f"NaN guard: could not read {file}: {error}")

    def restore(self, name: str, param: torch.Tensor) -> bool:
        """Copy the file's tensor for `name` into `param` if it matches (see the module docstring)."""
        from safetensors import safe_open

        target = local(param)
        for key in file_keys(name):
            if key not in self.files:
                continue
            with safe_open(self.files[key], framework="pt") as f:
                tensor = f.get_tensor(key)
            if tuple(tensor.shape) != tuple(target.shape):
                continue
            tensor = torch.empty_like(target).copy_(tensor)  # split into the same pieces as `target`
            if _matches(target.detach(), tensor):
                with torch.no_grad():
                    target.copy_(tensor)
                return True
        return False


def _matches(live: torch.Tensor, source: torch.Tensor) -> bool:
    """[`source_matches`] over `live` and `source` (same shape, dtype and device), in bounded chunks."""
    equal = finite = torch.zeros((), dtype=torch.int64, device=live.device)
    for a, b in zip(flat_chunks(live), flat_chunks(source)):
        ok = torch.isfinite(a)
        finite = finite + ok.sum()
        equal = equal + (ok & (a == b)).sum()
    return source_matches(int(equal), int(finite), live.numel())


__all__ = ["damaged_frozen", "file_keys", "model_files", "repair_frozen", "source_matches"]
