"""Frozen parameters: checked for NaN/Inf like the rest of the state, never copied into the snapshot.

The optimizer never changes a frozen parameter (a LoRA base is most of the model), so the snapshot does not hold one.
If one is ever found non-finite (written by a callback, a faulty kernel or device), a restore puts it back from where
it came from: the newest verified checkpoint of this run that holds it, else the model's own files. A file's tensor
is used only if it equals every value of the damaged parameter that is still finite, and at least half of them are:
weights changed in memory after loading (a merged adapter, resized embeddings) are never replaced by different values
from disk. What cannot be restored that way stops the run with a [`TrainingDivergedError`] naming it. A restore
from the host snapshot checks every parameter the snapshot does not hold, so one unfrozen after it was taken is
checked (and repaired or named) too.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Container, Iterable, Iterator

import torch

from ...errors import TrainingDivergedError
from ...runtime.finite import CHUNK_BYTES, all_finite
from ...runtime.sharding import local

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


def damaged_frozen(model: torch.nn.Module, held: Container[str] | None = None) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of `model` a restore did not put back holding NaN or Inf (one host read when none does).

    `held`: the names of the parameters the restore put back (a snapshot's); every other one is checked, including
    one frozen when the snapshot was taken and trainable since (gradual unfreezing). `None`: the frozen ones.
    """
    frozen = [
        (name, p)
        for name, p in model.named_parameters()
        if (not p.requires_grad if held is None else name not in held)
    ]
    if not frozen or bool(all_finite(p for _, p in frozen)):
        return []
    return [(name, p) for name, p in frozen if not bool(all_finite([p]))]


def repair_frozen(
    model: torch.nn.Module, checkpoints: Iterable[str], step: int, held: Container[str] | None = None
) -> list[str]:
    """Restore every damaged frozen parameter of `model` (every one not in `held`, see [`damaged_frozen`]) from the
    newest of `checkpoints` that holds a matching tensor, else from the model's files; return the names restored.

    Raises:
        [`TrainingDivergedError`]: some damaged frozen parameter has no matching source.
    """
    damaged = damaged_frozen(model, held)
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
            "not copy frozen parameters (the optimizer never changes them; a parameter unfrozen since the last "
            "snapshot was frozen when it was taken), and neither the verified checkpoints of "
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
        """Copy the file's tensor for `name` into `param` if it matches (see the module docstring), reading it in
        pieces ([`file_pieces`]): neither the host nor the device ever holds a whole copy of it."""
        from safetensors import safe_open

        target = local(param).detach()
        for key in file_keys(name):
            if key not in self.files:
                continue
            with safe_open(self.files[key], framework="pt") as f:
                if tuple(f.get_slice(key).get_shape()) != tuple(target.shape):
                    continue
                if _matches(file_pieces(target, f, key)):
                    with torch.no_grad():
                        for live, piece in file_pieces(target, f, key):
                            live.copy_(piece)
                    return True
        return False


def file_pieces(target: torch.Tensor, f, key: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`target` and the tensor `key` of the open safetensors file `f` (same shape) in matching pieces of whole
    leading rows (at least one), so that comparing a piece holds at most `CHUNK_BYTES`: a view of `target`, and the
    file's rows read only then, on `target`'s device and in its dtype."""
    if target.dim() == 0:
        yield target, f.get_tensor(key).to(target.device, target.dtype)
        return
    source = f.get_slice(key)
    # Up to 16 bytes an element are held while a piece is compared: the file's rows, their copy in `target`'s dtype
    # and device, and the comparison's masks.
    rows = max(CHUNK_BYTES // (16 * max(target[0].numel(), 1)), 1)
    for start in range(0, target.shape[0], rows):
        yield target[start : start + rows], source[start : start + rows].to(target.device, target.dtype)


def _matches(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """[`source_matches`] over pairs of a live piece and the file's piece (same shape, dtype and device)."""
    counts, numel = None, 0  # [finite, equal to the file] on the device: one host read at the end
    for a, b in pieces:
        ok = torch.isfinite(a)
        piece = torch.stack([torch.count_nonzero(ok), torch.count_nonzero(ok & (a == b))])  # no int64 copy
        counts = piece if counts is None else counts + piece
        numel += a.numel()
    finite, equal = counts.tolist() if counts is not None else (0, 0)
    return source_matches(equal, finite, numel)


__all__ = ["damaged_frozen", "file_keys", "model_files", "repair_frozen", "source_matches"]
