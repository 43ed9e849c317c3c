"""Reads an offline W&B run's transaction log (`run-<id>.wandb`) back: the records its writer appended, in the
LevelDB log layout W&B uses (a 7-byte header `:W&B`, magic, version; then 32 KiB blocks of chunks, each a 7-byte
header: checksum, length, type (1 full, 2 first, 3 middle, 4 last) and the bytes), as `wandb_internal_pb2.Record`s."""

from __future__ import annotations

import glob
import json
import os
import struct
import time

HEADER = 7
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> list:
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    if len(data) < HEADER:
        return []  # W&B's service has created the file but not yet written its header
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pos, parts = [], HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if pos + HEADER + length > len(data):
            break  # a chunk still being written
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        assert kind in (FULL, FIRST, MIDDLE, LAST) and (kind in (FULL, FIRST)) == (not parts), f"bad chunk at {pos}"
        parts.append(chunk)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def finished_records(path: str, timeout: float = 60.0) -> list:
    """The records of the run at `path` once its `exit` record is written: `wandb.finish()` may return before W&B's
    service process has written the last records of an offline run."""
    deadline = time.monotonic() + timeout
    while True:
        out = records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def run_file(wandb_dir: str) -> str:
    """The transaction log of the one offline run under `wandb_dir`."""
    found = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(found) == 1, found
    return found[0]


def of_kind(written: list, kind: str) -> list:
    """The payloads of the records of one type (`"alert"`, `"summary"`, `"history"`, ...), in order."""
    return [getattr(r, kind) for r in written if r.WhichOneof("record_type") == kind]


def summary(written: list) -> dict:
    """The run summary as the records left it (each update over the earlier ones)."""
    return {item.key: json.loads(item.value_json) for update in of_kind(written, "summary") for item in update.update}


def history_rows(written: list) -> list[dict]:
    """The history rows, each `{key: value}` (a nested key joined with `/`)."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in h.item}
            for h in of_kind(written, "history")]  # fmt: skip
