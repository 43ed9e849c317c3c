"""The replay bundle on disk: `output_dir/nan_replay/step-N/`, one per faulted step (docs/replay.md).

* `meta.json` (main process): what the bundle is (step, events, trainer kind, the checkpoint to replay from, the
  in-loop diagnosis, the state entries found non-finite, the test faults that fired, the sizes, what was left out);
* `args.json` (main process): the trainer's config, as `to_dict()` writes it (`hub_token` hidden), to rebuild it;
* `rank-<r>.pt` (each writing process): its micro-batches, the non-finite state entries, GRPO/RLOO's rewards,
  loadable with `torch.load(weights_only=True)`.

Files are written whole (a temporary file created with `O_EXCL | O_NOFOLLOW`, renamed over the name), so a reader
sees an old bundle's file or the new one, and a link at a name is replaced, never written through.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch

from ..restarts.rotation import rotation_victims
from ..runtime.files import link_refused, write_file_no_follow, write_text_no_follow
from ..runtime.nested import map_tensors, tensors

REPLAY_DIR = "nan_replay"
META_FILE = "meta.json"
ARGS_FILE = "args.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


def bundle_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, REPLAY_DIR, f"step-{step}")


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def bundle_steps(output_dir: str) -> list[int]:
    """The steps with a bundle in `output_dir` (a `step-N` directory with its `meta.json`), in order."""
    root = os.path.join(output_dir, REPLAY_DIR)
    if not os.path.isdir(root):
        return []
    found = [_STEP_DIR.match(name) for name in os.listdir(root)]
    return sorted(int(m.group(1)) for m in found if m and os.path.isfile(os.path.join(root, m.group(0), META_FILE)))


def nbytes(value: Any) -> int:
    """Bytes of the tensors and the text of a nested structure (a poisoned GRPO/RLOO step's batch is the dataset's
    rows: prompts as text, which a file holds as much as tensors)."""
    text = []
    map_tensors(value, lambda t: None, lambda leaf: text.append(_text_bytes(leaf)))
    return sum(t.numel() * t.element_size() for t in tensors(value)) + sum(text)


def _text_bytes(leaf: Any) -> int:
    if isinstance(leaf, str):
        return len(leaf.encode("utf-8", "surrogatepass"))
    return len(leaf) if isinstance(leaf, (bytes, bytearray)) else 0


def fit(items: list[tuple[str, Any]], limit: int) -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
    """Keep `items` (name, value) in order while their bytes ([`nbytes`]) add up to at most `limit`; an item that
    does not fit is left out and the next ones are still tried.

    Returns:
        `(kept, sizes, left_out)`: the kept items by name, and the bytes of the kept and of the left-out ones.
    """
    kept, sizes, left_out, used = {}, {}, {}, 0
    for name, value in items:
        size = nbytes(value)
        if used + size <= limit:
            kept[name], sizes[name], used = value, size, used + size
        else:
            left_out[name] = size
    return kept, sizes, left_out


def _fresh_dir(path: str) -> None:
    """`path` as a real directory (created if missing); a link there is refused, not followed."""
    if os.path.islink(path):
        raise link_refused(path)
    os.makedirs(path, exist_ok=True)


def write_bundle(output_dir: str, step: int, rank: int, payload: dict[str, Any], meta: dict | None = None,
                 args: dict | None = None) -> str:  # fmt: skip
    """Write this process's `payload` of step `step`'s bundle (and, from the main process, `meta` and `args`).
    Returns the bundle's directory."""
    _fresh_dir(os.path.join(output_dir, REPLAY_DIR))
    directory = bundle_dir(output_dir, step)
    _fresh_dir(directory)
    write_file_no_follow(os.path.join(directory, rank_file(rank)), lambda f: torch.save(payload, f), binary=True)
    if args is not None:
        write_text_no_follow(os.path.join(directory, ARGS_FILE), json.dumps(args, indent=1, default=str))
    if meta is not None:  # last: a bundle is listed once its meta is there
        write_text_no_follow(os.path.join(directory, META_FILE), json.dumps({"format": FORMAT, **meta}, indent=1))
    return directory


def read_bundle(output_dir: str, step: int, rank: int | None = None) -> tuple[dict, dict, dict[str, Any]]:
    """`(meta, args, payload)` of step `step`'s bundle; the payload of `rank`, by default the rank where the in-loop
    diagnosis found the module, else the first rank the meta lists whose loss was non-finite, else (a state found
    damaged by the check alone) the first whose state was, else the lowest written. Tensors are loaded with torch's
    safe unpickler."""
    directory = bundle_dir(output_dir, step)
    with open(os.path.join(directory, META_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    with open(os.path.join(directory, ARGS_FILE), encoding="utf-8") as f:
        args = json.load(f)
    written = sorted(int(n[5:-3]) for n in os.listdir(directory) if re.fullmatch(r"rank-\d+\.pt", n))
    if rank is None:
        found_on = (meta.get("in_loop_diagnosis") or {}).get("rank")
        preferred = ([found_on] if found_on is not None else []) + list(meta.get("ranks", []))
        preferred += list(meta.get("damaged_ranks", []))  # a state found damaged by the check alone: where it was
        rank = next((r for r in preferred if r in written), written[0] if written else 0)
    payload = torch.load(os.path.join(directory, rank_file(rank)), weights_only=True, map_location="cpu")
    return meta, args, payload


def rotate_bundles(output_dir: str, newest: int, limit: int) -> list[int]:
    """Delete the oldest bundles so that at most `limit` of those numbered up to `newest` remain (the newest always
    stays: as `save_total_limit` rotates checkpoints, `restarts/rotation.py`). Returns the steps deleted."""
    gone = rotation_victims(bundle_steps(output_dir), newest, limit)
    for step in gone:
        shutil.rmtree(bundle_dir(output_dir, step), ignore_errors=True)
    return gone


__all__ = ["REPLAY_DIR", "bundle_dir", "bundle_steps", "fit", "nbytes", "read_bundle", "rotate_bundles", "write_bundle"]
