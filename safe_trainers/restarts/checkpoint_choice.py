"""Which checkpoint a run resumes from: the newest that is complete and finite, and why each newer one was passed over.

transformers' `resume_from_checkpoint=True` takes the highest-numbered `checkpoint-N` directory, even one a crash left
half-written or one another tool saved with NaN weights. Here each candidate is examined, newest first:

* complete: it has `trainer_state.json` and model weights (a full model, a PEFT adapter, a sharded index whose shards
  all exist, or a DeepSpeed / FSDP state directory), and every file was written to the end: each JSON parses, each
  safetensors file is as long as its header says, each torch file's zip directory can be read (`completeness.py`);
* safe: the pickled state DeepSpeed and DCP load with `weights_only=False` needs no class outside the allowlist of
  those they store (`pickled_state.py`): a planted or foreign checkpoint runs nothing;
* finite: every floating tensor of its weights and of `optimizer.pt` is finite. Safetensors files are read one tensor
  at a time; `.bin`/`.pt` files are memory-mapped. DeepSpeed and FSDP state directories are checked for presence only.

A damaged file (a truncated or malformed JSON, index or safetensors header; a shard name that leaves the checkpoint)
makes its checkpoint passed over with the reason, never an error out of the choice.

The checks read files and change nothing; [`choose_checkpoint`] is deterministic: run on the same directory, it always
picks the same checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from safetensors import safe_open
from transformers.trainer import TRAINER_STATE_NAME

from ..runtime.checkpoint_dirs import checkpoints
from ..runtime.finite import any_nonfinite
from ..runtime.nested import named_tensors
from .completeness import BACKEND_STATE_PREFIXES, incomplete_checkpoint, read_json
from .pickled_state import trust_hint, unsafe_state_problem

OPTIMIZER = "optimizer.pt"
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class PassedOver:
    """A checkpoint that was not resumed from, and why (`reason` reads after "passed over: ")."""

    path: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"checkpoint": self.path, "reason": self.reason}


@dataclass(frozen=True)
class CheckpointChoice:
    """The checkpoint to resume from (`None`: no usable one) and the newer ones passed over, newest first."""

    path: str | None
    passed_over: tuple[PassedOver, ...] = ()


def choose_checkpoint(
    run_dir: str, problem: Callable[[str], str | None] | None = None
) -> CheckpointChoice:
    """The newest `checkpoint-N` of `run_dir` that `problem` (default [`checkpoint_problem`]) finds nothing wrong with.

    Example:
        ```python
        >>> choice = choose_checkpoint("out/dpo")
        >>> choice.path, [(p.path, p.reason) for p in choice.passed_over]
        ('out/dpo/checkpoint-40', [('out/dpo/checkpoint-50', 'incomplete: no `trainer_state.json` ...')])
        ```
    """
    problem = problem or checkpoint_problem
    passed: list[PassedOver] = []
    for path in reversed(checkpoints(run_dir)):
        reason = problem(path)
        if reason is None:
            return CheckpointChoice(path, tuple(passed))
        passed.append(PassedOver(path, reason))
    return CheckpointChoice(None, tuple(passed))


def checkpoint_problem(path: str, trusted: Iterable[str] = ()) -> str | None:
    """Why `path` cannot be resumed from (incomplete, unreadable, unsafe, non-finite), or `None` if it can.
    `trusted`: globals its pickled backend state may hold beyond the allowlist (`trusted_checkpoint_globals`)."""
    if not os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
        return f"incomplete: no `{TRAINER_STATE_NAME}` (a save that did not finish, or not a Trainer checkpoint)"
    unfinished = incomplete_checkpoint(path)
    if unfinished is not None:
        return f"incomplete: {unfinished}"
    files, missing = weight_files(path)
    if missing:
        return missing
    if not files and not _has_backend_state(path):
        return "incomplete: no model weights"
    unsafe = safety_problem(path, trusted)
    if unsafe is not None:
        return unsafe
    optimizer = os.path.join(path, OPTIMIZER)
    for file in files + ([optimizer] if os.path.isfile(optimizer) else []):
        try:
            bad = next(_nonfinite_tensors(file), None)
        except Exception as error:  # a truncated or corrupt file
            return f"unreadable: `{os.path.basename(file)}` ({type(error).__name__}: {error})"
        if bad is not None:
            return f"non-finite: `{bad}` in `{os.path.basename(file)}`"
    return None


def checker(trusted: Iterable[str]) -> Callable[[str], str | None]:
    """[`checkpoint_problem`] with the user's trusted globals."""
    return partial(checkpoint_problem, trusted=tuple(trusted))


def safety_problem(path: str, trusted: Iterable[str] = ()) -> str | None:
    """Why loading the checkpoint at `path` could run code it carries ("unsafe: ..."), or `None`."""
    try:
        unsafe = unsafe_state_problem(path, trusted)
    except Exception as error:  # a file that cannot be read to the end: nothing of it is trusted
        unsafe = f"its backend state cannot be checked ({type(error).__name__}: {error})"
    return None if unsafe is None else f"unsafe: {unsafe}; {trust_hint(path)}"


def weight_files(path: str) -> tuple[list[str], str | None]:
    """The weight files of a checkpoint, and why its sharded index is not usable (if so: it does not parse, is not a
    `weight_map` of shard file names inside the checkpoint, or names a shard that does not exist)."""
    files = [os.path.join(path, name) for name in WEIGHT_FILES if os.path.isfile(os.path.join(path, name))]
    for index in WEIGHT_INDEXES:
        index_path = os.path.join(path, index)
        if not os.path.isfile(index_path):
            continue
        shards, problem = index_shards(index_path)
        if problem is not None:
            return files, f"incomplete: `{index}` {problem}"
        for shard in shards:
            if not os.path.isfile(os.path.join(path, shard)):
                return files, f"incomplete: `{shard}` is missing"
        files += [os.path.join(path, shard) for shard in shards]
    return files, None


def index_shards(index_path: str) -> tuple[list[str], str | None]:
    """The shard files a sharded index names, or why it is not usable."""
    index, problem = read_json(index_path)
    if problem is not None:
        return [], problem
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return [], "holds no `weight_map` of tensor names to shard file names"
    shards = sorted(set(weight_map.values()))
    outside = [s for s in shards if os.path.basename(s) != s or s in ("", ".", "..")]
    if outside:
        return [], f"names a shard outside the checkpoint (`{outside[0][:80]}`): a shard is a file name beside it"
    return shards, None


def _has_backend_state(path: str) -> bool:
    names = os.listdir(path)
    return any(name.startswith(BACKEND_STATE_PREFIXES) and os.path.isdir(os.path.join(path, name)) for name in names)


def _nonfinite_tensors(file: str) -> Iterator[str]:
    """The names of the floating tensors of `file` that hold a NaN or Inf, reading one tensor at a time."""
    if file.endswith(".safetensors"):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if any_nonfinite(f.get_tensor(name)):  # in bounded pieces, with no copy of the tensor
                    yield name
        return
    for name, tensor in named_tensors(torch.load(file, map_location="cpu", mmap=True, weights_only=True)):
        if any_nonfinite(tensor):
            yield name
