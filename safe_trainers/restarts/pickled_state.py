"""Whether a checkpoint's pickled backend state can be loaded without running code it carries.

transformers loads a checkpoint's own torch files (`optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, FSDP's `.bin`
files) with torch's safe unpickler (`weights_only=True`), but two backends do not:

* DeepSpeed's `load_checkpoint` reads every torch file of the `global_step*` directory that the `latest` file names
  with `weights_only=False`: a pickle there runs whatever function it names;
* DCP (FSDP's `SHARDED_STATE_DICT`: `pytorch_model_fsdp_0/`, `optimizer_0/`) reads `.metadata` with `pickle.load`,
  and the non-tensor items stored in its `.distcp` files with `weights_only=False`.

So before a checkpoint is chosen, these files are read here with an allowlist of exactly the classes DeepSpeed and
DCP store ([`ALLOWED_GLOBALS`], found by listing the globals of real ZeRO-2, ZeRO-3 and FSDP2 checkpoints): torch
files with torch's safe unpickler (`torch.load(weights_only=True, mmap=True)`: the tensor storages are mapped, not
read), `.metadata` with an unpickler that resolves nothing else, and each non-tensor `.distcp` item with torch's safe
unpickler. A file that needs any other global, or a `latest` / storage entry that points outside the checkpoint, makes
the checkpoint unusable: [`unsafe_state_problem`] says why. Users trust more globals with the
`trusted_checkpoint_globals` setting.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Iterable
from importlib import import_module
from typing import Any

import torch

# dotted name -> who stores it (the globals of real checkpoints; `get_unsafe_globals_in_checkpoint` lists the DeepSpeed
# ones, torch's safe unpickler allows the rest by default).
DEEPSPEED_GLOBALS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "ZeRO optimizer states (`loss_scaler`, bf16/fp32 runs)",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "ZeRO optimizer states (`loss_scaler`, fp16 runs)",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "ZeRO optimizer states (`zero_stage`)",
    "deepspeed.utils.tensor_fragment.fragment_address": "ZeRO-1/2 optimizer states (`param_slice_mappings`)",
}
DCP_METADATA_GLOBALS = {
    f"torch.distributed.checkpoint.metadata.{name}": "DCP `.metadata`"
    for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    )
} | {
    "torch.distributed.checkpoint.filesystem._StorageInfo": "DCP `.metadata` (where each item is stored)",
    "torch.Size": "DCP `.metadata` (tensor and chunk sizes)",
    "torch.serialization._get_layout": "DCP `.metadata` (tensor layouts)",
    "pathlib.PosixPath": "DCP `.metadata` (`StorageMeta.checkpoint_id`)",
    "pathlib.WindowsPath": "DCP `.metadata` (`StorageMeta.checkpoint_id`, saved on Windows)",
}  # fmt: skip
ALLOWED_GLOBALS = DEEPSPEED_GLOBALS | DCP_METADATA_GLOBALS
DEEPSPEED_LATEST = ("latest", "latest_universal")
# The longest `latest` file read (a tag is a directory name); DeepSpeed reads all of a longer one.
LATEST_LIMIT = 256
DCP_METADATA = ".metadata"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# The most bytes of pickle read from one file (a torch file's `data.pkl`, a `.metadata`, a `.distcp` item): the
# structure, not the tensors, which is a few MB even for large models.
PICKLE_LIMIT = 256 * 2**20


def unsafe_state_problem(path: str, trusted: Iterable[str] = ()) -> str | None:
    """Why loading the backend state of the checkpoint at `path` could run code it carries (after "unsafe: "), or
    `None`. `trusted`: dotted names of globals allowed beyond [`ALLOWED_GLOBALS`]."""
    allowed = set(ALLOWED_GLOBALS) | set(trusted)
    for name in sorted(os.listdir(path)):
        sub = os.path.join(path, name)
        if name in DEEPSPEED_LATEST and os.path.isfile(sub):
            problem = _latest_problem(path, sub, allowed)
        elif name.startswith("global_step") and os.path.isdir(sub):
            problem = _tag_problem(sub, allowed)
        elif os.path.lexists(os.path.join(sub, DCP_METADATA)):
            problem = _dcp_problem(sub, allowed)
        else:
            continue
        if problem is not None:
            return problem.replace(path + os.sep, "")
    return None


def trust_hint(path: str) -> str:
    return (
        f"loading it would run code a DeepSpeed or DCP checkpoint never holds; if you wrote {path} yourself and trust "
        "it, add the names to the `trusted_checkpoint_globals` setting"
    )


def _first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p is not None), None)


def _files(directory: str, suffixes: tuple[str, ...]) -> list[str]:
    return [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.endswith(suffixes)]


def _latest_problem(path: str, latest: str, allowed: set[str]) -> str | None:
    """DeepSpeed loads the tag directory `latest` names (all of the file, stripped), whatever its name: it must be a
    directory of the checkpoint, and its files are checked as a `global_step*` one's."""
    with open(latest, "rb") as f:
        raw = f.read(LATEST_LIMIT + 1)
    tag = raw[:LATEST_LIMIT].decode("utf-8", "replace").strip()
    name = os.path.basename(latest)
    if len(raw) > LATEST_LIMIT:
        return f"`{name}` names `{tag[:80]}...`, over {LATEST_LIMIT} bytes (not read to the end; DeepSpeed loads it)"
    if os.path.basename(tag) != tag or tag in ("", ".", "..") or not os.path.isdir(os.path.join(path, tag)):
        return f"`{name}` names `{tag[:80]}`, not a `global_step*` directory of the checkpoint (DeepSpeed loads it)"
    return None if tag.startswith("global_step") else _tag_problem(os.path.join(path, tag), allowed)


def _tag_problem(directory: str, allowed: set[str]) -> str | None:
    return _first(_torch_file_problem(f, allowed) for f in _files(directory, TORCH_SUFFIXES))


def _not_regular(file: str) -> str | None:
    """Why the backend would not read `file` to its end as a file (a FIFO blocks, and runs what is written to it)."""
    if os.path.isfile(file):
        return None
    return f"`{file}` is not a regular file (missing, or a FIFO, device or socket: reading it can block or never end)"


def _needs(file: str, names: Iterable[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in sorted(names))
    return f"`{file}` needs {shown}"


def _torch_file_problem(file: str, allowed: set[str]) -> str | None:
    """Load `file` with torch's safe unpickler and the allowlist (tensors memory-mapped, not read)."""
    if _not_regular(file):
        return _not_regular(file)
    if not zipfile.is_zipfile(file):
        return f"`{file}` is not a torch zip file (cannot be checked)"
    with zipfile.ZipFile(file) as archive:
        pickles = [m for m in archive.infolist() if m.filename.endswith("data.pkl")]
    if len(pickles) != 1 or pickles[0].file_size > PICKLE_LIMIT:
        return f"`{file}` holds no `data.pkl` of at most {PICKLE_LIMIT} bytes (cannot be checked)"
    with torch.serialization.safe_globals(_resolved(allowed)):
        try:
            torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError as error:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
            return _needs(file, unsafe) if unsafe else f"`{file}` {_first_line(error)}"
    return None


def _dcp_problem(directory: str, allowed: set[str]) -> str | None:
    metadata_path = os.path.join(directory, DCP_METADATA)
    if _not_regular(metadata_path):
        return _not_regular(metadata_path)
    if os.path.getsize(metadata_path) > PICKLE_LIMIT:
        return f"`{metadata_path}` is over {PICKLE_LIMIT} bytes (cannot be checked)"
    with open(metadata_path, "rb") as f:
        unpickler = _AllowlistUnpickler(f, allowed)
        try:
            metadata = unpickler.load()
        except Exception as error:  # a global outside the allowlist, or a damaged pickle
            if unpickler.refused:
                return _needs(metadata_path, unpickler.refused)
            return f"`{metadata_path}` cannot be read ({type(error).__name__}: {error})"
    try:
        items = [(i.fqn, metadata.storage_data[i]) for i in metadata.storage_data if _is_bytes(metadata, i.fqn)]
    except (AttributeError, TypeError, KeyError) as error:
        return f"`{metadata_path}` is not DCP metadata ({type(error).__name__}: {error})"
    for fqn, info in items:
        problem = _dcp_item_problem(directory, fqn, info, allowed)
        if problem is not None:
            return problem
    return None


def _is_bytes(metadata: Any, fqn: str) -> bool:
    return type(metadata.state_dict_metadata[fqn]).__name__ == "BytesStorageMetadata"


def _dcp_item_problem(directory: str, fqn: str, info: Any, allowed: set[str]) -> str | None:
    """The non-tensor item `fqn` of a DCP directory, which DCP loads with `weights_only=False`."""
    name, offset, length = info.relative_path, info.offset, info.length
    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
        return f"`{directory}/{DCP_METADATA}` stores `{fqn}` outside the directory (`{str(name)[:80]}`)"
    if not (isinstance(offset, int) and isinstance(length, int) and 0 <= length <= PICKLE_LIMIT and offset >= 0):
        return f"`{directory}/{DCP_METADATA}` gives `{fqn}` an offset or length out of bounds"
    file = os.path.join(directory, name)
    if _not_regular(file):
        return _not_regular(file)
    with open(file, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    with torch.serialization.safe_globals(_resolved(allowed)):
        try:
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as error:  # an unsafe global, or bytes that are no torch file
            unsafe = _unsafe_in(raw)
            return _needs(f"{file}` item `{fqn}", unsafe) if unsafe else f"`{file}` item `{fqn}` {_first_line(error)}"
    return None


def _unsafe_in(raw: bytes) -> list[str]:
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(raw))
    except Exception:  # not a torch file: the caller names the load's own error
        return []


def _first_line(error: Exception) -> str:
    return f"cannot be loaded safely ({type(error).__name__}: {str(error).strip().splitlines()[0][:200]})"


def _resolved(names: Iterable[str]) -> list[Any]:
    """The objects of the allowed dotted names that can be imported (a checkpoint that needs one that cannot, e.g.
    DeepSpeed's when it is not installed, cannot be loaded anyway)."""
    out = []
    for dotted in sorted(names):
        value = _lookup(dotted)
        if value is not None:
            out.append((value, dotted) if getattr(value, "__module__", None) else value)
    return out


def _lookup(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


class _AllowlistUnpickler(pickle.Unpickler):
    """Resolves only the allowed globals (and torch's dtypes); records the first it refuses."""

    def __init__(self, file, allowed: set[str]):
        super().__init__(file)
        self.allowed = allowed
        self.refused: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        dotted = f"{module}.{name}"
        value = _lookup(dotted) if dotted in self.allowed or module == "torch" else None
        if module == "torch" and dotted not in self.allowed and not isinstance(value, torch.dtype):
            value = None
        if value is None:
            self.refused.append(dotted)
            raise pickle.UnpicklingError(f"global `{dotted}` is not allowed")
        return value

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent ids")
