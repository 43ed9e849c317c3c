"""Whether every file of a checkpoint was written to the end: read cheaply, from headers and sizes.

A checkpoint saved in place (by stock TRL, another tool, or a save killed half-way on a filesystem without atomic
renames) can hold an empty or truncated `trainer_state.json`, or a weight file cut short: transformers then fails at
resume (`JSONDecodeError`) on every restart. A file is complete when:

* JSON (`trainer_state.json`, `config.json`, indexes, the guard's state, tokenizer files): it is at most
  `JSON_LIMIT` bytes (a larger one is not read), it parses, and the files the resume reads have the shape it reads
  (`trainer_state.json`: an object with an integer `global_step` and fields of the types transformers restores; the
  guard's `nan_guard_state.json`: see `runtime/guard_state_file.py`);
* safetensors: its header length is at most `HEADER_LIMIT` and inside the file (checked before anything is
  allocated), the header parses into entries with two integer `data_offsets`, and the file is exactly as long as the
  header's tensor offsets say;
* torch files (`.bin`, `.pt`, `.pth`: optimizer, scheduler, RNG states, training arguments, DeepSpeed's
  `global_step*/` shards): a zip archive whose central directory (written last) can be read, and whose members lie
  inside the file; no tensor is loaded.

The checks read at most the headers and the directory of each file (the JSON files in full), change nothing, and
name the first incomplete file with the reason.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zipfile
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from transformers import TrainerState
from transformers.trainer import TRAINER_STATE_NAME

from ..runtime.guard_state_file import GUARD_STATE_FILE, guard_state_problem
from .pickled_state import DEEPSPEED_LATEST, LATEST_LIMIT

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# Directories in which a backend keeps its own sharded state (DeepSpeed's `global_step<N>`, FSDP's model shards).
BACKEND_STATE_PREFIXES = ("global_step", "pytorch_model_fsdp")
# The largest JSON file of a checkpoint read whole (a long run's `trainer_state.json` is a few MB, a tokenizer tens).
JSON_LIMIT = 512 * 2**20
# The largest safetensors header read (the bound the safetensors library itself enforces).
HEADER_LIMIT = 100_000_000
# What the resume reads of `trainer_state.json` (transformers' `TrainerState` fields): field -> the types it accepts;
# transformers restores the file with `TrainerState(**fields)`, so a field it does not have fails the resume.
TRAINER_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "global_step": (int,),
    "epoch": (int, float, type(None)),
    "max_steps": (int,),
    "log_history": (list,),
    "best_metric": (int, float, type(None)),
    "best_global_step": (int, type(None)),
    "best_model_checkpoint": (str, type(None)),
    "stateful_callbacks": (dict, type(None)),
    "num_train_epochs": (int, float),
    "total_flos": (int, float),
}


def incomplete_file(path: str) -> str | None:
    """Why the file at `path` was not written to the end (after "`<name>` "), or `None` if it was, or is not a JSON,
    safetensors or torch file."""
    name = os.path.basename(path)
    if not name.endswith((".json", ".safetensors", *TORCH_SUFFIXES)):
        return None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # opening a FIFO blocks until another process writes to it
            return "is not a regular file (a FIFO, device or socket: reading it can block or never end)"
        if name.endswith(".json"):
            return _json_problem(path, name)
        if name.endswith(".safetensors"):
            return _safetensors_problem(path)
        if name.endswith(TORCH_SUFFIXES):
            return _torch_zip_problem(path)
    except (OSError, zipfile.BadZipFile) as error:
        return f"cannot be read ({type(error).__name__}: {error})"
    return None


def incomplete_checkpoint(path: str) -> str | None:
    """The first file of the checkpoint at `path` (its own files, and those of a DeepSpeed state directory) that was
    not written to the end, as "`<name>` <why>", or `None`."""
    names = sorted(os.listdir(path))
    files = [os.path.join(path, name) for name in names if os.path.isfile(os.path.join(path, name))]
    for name in names:
        sub = os.path.join(path, name)
        if name.startswith(BACKEND_STATE_PREFIXES) and os.path.isdir(sub):
            files += [os.path.join(sub, n) for n in sorted(os.listdir(sub)) if n.endswith(TORCH_SUFFIXES)]
    for file in files:
        problem = incomplete_file(file)
        if problem is not None:
            return f"`{os.path.relpath(file, path)}` {problem}"
    return deepspeed_tag_problem(path, names)


def deepspeed_tag_problem(path: str, names: list[str]) -> str | None:
    """DeepSpeed resumes from the state directory its `latest` file names: with `global_step*` state and no usable
    `latest` (missing, not a file, naming no directory of the checkpoint or an empty one), transformers' resume raises,
    so the checkpoint is passed over, as "`latest` <why>"."""
    if not any(n.startswith("global_step") and os.path.isdir(os.path.join(path, n)) for n in names):
        return None
    latest = os.path.join(path, DEEPSPEED_LATEST[0])  # `latest_universal` only for a universal checkpoint
    if not os.path.isfile(latest):
        return f"`{DEEPSPEED_LATEST[0]}` is missing or not a file: nothing names the DeepSpeed state (`global_step*`)"
    with open(latest, "rb") as f:
        tag = f.read(LATEST_LIMIT).decode("utf-8", "replace").strip()
    state = os.path.join(path, tag)
    if tag in ("", ".", "..") or os.path.basename(tag) != tag or not os.path.isdir(state):
        return f"`{DEEPSPEED_LATEST[0]}` names `{tag[:80]}`, no DeepSpeed state directory of the checkpoint"
    if not any(n.endswith(TORCH_SUFFIXES) for n in os.listdir(state)):
        return f"`{DEEPSPEED_LATEST[0]}` names `{tag}`, which holds no state file"
    return None


def read_json(path: str, limit: int = JSON_LIMIT) -> tuple[Any, str | None]:
    """The value of the JSON file at `path`, or why it is not usable (empty, over `limit` bytes: not read, does not
    parse, cannot be read) as `(None, reason)`."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return None, "is empty"
        if size > limit:
            return None, f"is {size} bytes, over the {limit} read for a JSON file (not read)"
        with open(path, "rb") as f:
            return json.loads(f.read(limit + 1)), None
    except (ValueError, RecursionError) as error:  # also a UnicodeDecodeError; JSON nested too deep to parse
        return None, f"does not parse ({type(error).__name__}: {error})"
    except OSError as error:
        return None, f"cannot be read ({type(error).__name__}: {error})"


def trainer_state_problem(value: Any) -> str | None:
    """Why a parsed `trainer_state.json` cannot be restored by transformers (after "`trainer_state.json` "), or
    `None`."""
    if not (isinstance(value, dict) and isinstance(value.get("global_step"), int)):
        return "holds no `global_step`"
    unknown = sorted(set(value) - {f.name for f in fields(TrainerState)})
    if unknown:
        return f"holds `{unknown[0][:80]}`, not a field of transformers' `TrainerState` (it cannot restore the file)"
    for key, types in TRAINER_STATE_TYPES.items():
        if key in value and (not isinstance(value[key], types) or isinstance(value[key], bool)):
            return f"holds `{key}` of type `{type(value[key]).__name__}`"
    return None


# The files whose parsed content the resume reads, and the check of its shape.
JSON_SHAPES: dict[str, Callable[[Any], str | None]] = {
    TRAINER_STATE_NAME: trainer_state_problem,
    GUARD_STATE_FILE: guard_state_problem,
}


def _json_problem(path: str, name: str) -> str | None:
    value, problem = read_json(path)
    if problem is None and name in JSON_SHAPES:
        problem = JSON_SHAPES[name](value)
    return problem


def _safetensors_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes: no header)"
        (length,) = struct.unpack("<Q", head)
        if length > HEADER_LIMIT:
            return f"has a header length of {length} bytes, over the {HEADER_LIMIT} safetensors allows (not read)"
        if 8 + length > size:
            return f"is truncated (a header of {length} bytes in a file of {size})"
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError) as error:
            return f"has a header that does not parse ({type(error).__name__}: {error})"
    if not isinstance(header, dict):
        return "has a header that is not an object"
    ends = [_data_end(entry) for key, entry in header.items() if key != "__metadata__"]
    if None in ends:
        bad = next(key for key, entry in header.items() if key != "__metadata__" and _data_end(entry) is None)
        return f"has a header entry `{bad[:80]}` without two integer `data_offsets`"
    data = size - 8 - length
    if max(ends, default=0) != data:
        return f"is truncated (its header places {max(ends, default=0)} bytes of tensors, the file holds {data})"
    return None


def _data_end(entry: Any) -> int | None:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        return None
    return offsets[1] if offsets[0] <= offsets[1] else None


def _torch_zip_problem(path: str) -> str | None:
    if not zipfile.is_zipfile(path):
        return "is not a complete torch file (no zip directory at its end: truncated, or not written by torch.save)"
    size = os.path.getsize(path)
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
    if not members:
        return "is an empty archive"
    past = [m.filename for m in members if m.header_offset + m.compress_size > size]
    if past:
        return f"is truncated (`{past[0]}` ends past the end of the file)"
    return None
