"""Whether every file of a checkpoint was written to the end: read cheaply, from headers and sizes.

A checkpoint saved in place (by stock TRL, another tool, or a save killed half-way on a filesystem without atomic
renames) can hold an empty or truncated `trainer_state.json`, or a weight file cut short: transformers then fails at
resume (`JSONDecodeError`) on every restart. A file is complete when:

* JSON (`trainer_state.json`, `config.json`, indexes, the guard's state, tokenizer files): it parses, and
  `trainer_state.json` is an object with an integer `global_step`;
* safetensors: its header parses and the file is exactly as long as the header's tensor offsets say;
* torch files (`.bin`, `.pt`, `.pth`: optimizer, scheduler, RNG states, training arguments, DeepSpeed's
  `global_step*/` shards): a zip archive whose central directory (written last) can be read, and whose members lie
  inside the file; no tensor is loaded.

The checks read at most the headers and the directory of each file (the JSON files in full), change nothing, and
name the first incomplete file with the reason.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile

from transformers.trainer import TRAINER_STATE_NAME

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# Directories in which a backend keeps its own sharded state (DeepSpeed's `global_step<N>`, FSDP's model shards).
BACKEND_STATE_PREFIXES = ("global_step", "pytorch_model_fsdp")


def incomplete_file(path: str) -> str | None:
    """Why the file at `path` was not written to the end (after "`<name>` "), or `None` if it was, or is not a JSON,
    safetensors or torch file."""
    name = os.path.basename(path)
    try:
        if name.endswith(".json"):
            return _json_problem(path, name)
        if name.endswith(".safetensors"):
            return _safetensors_problem(path)
        if name.endswith(TORCH_SUFFIXES):
            return _torch_zip_problem(path)
    except OSError as error:
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
    return None


def _json_problem(path: str, name: str) -> str | None:
    if os.path.getsize(path) == 0:
        return "is empty"
    with open(path, "rb") as f:
        try:
            value = json.loads(f.read())
        except ValueError as error:
            return f"does not parse ({type(error).__name__}: {error})"
    if name == TRAINER_STATE_NAME and not (isinstance(value, dict) and isinstance(value.get("global_step"), int)):
        return "holds no `global_step`"
    return None


def _safetensors_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes: no header)"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"is truncated (a header of {length} bytes in a file of {size})"
        try:
            header = json.loads(f.read(length))
        except ValueError as error:
            return f"has a header that does not parse ({type(error).__name__}: {error})"
    if not isinstance(header, dict):
        return "has a header that is not an object"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    data = size - 8 - length
    if max(ends, default=0) != data:
        return f"is truncated (its header places {max(ends, default=0)} bytes of tensors, the file holds {data})"
    return None


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
