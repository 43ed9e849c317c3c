"""What `safe-trainers replay` prints: the replay's finding beside the in-loop diagnosis, and whether they agree."""

from __future__ import annotations

import math
import os
from typing import Any

from .rerun import Replayed


def where(found: dict[str, Any] | None) -> str:
    """One diagnosis in words: `model.layers.1 (Gemma2DecoderLayer), micro-batch 0 of 1, rows [0, 1]`."""
    if not found:
        return "none recorded"
    if not found.get("module"):
        return f"no module output went non-finite ({found.get('reason', 'every output was finite')})"
    text = f"{found['module']} ({found.get('type', '?')})"
    if "micro_batch" in found:
        text += f", micro-batch {found['micro_batch']} of {found.get('micro_batches', '?')}"
    if "rows" in found:
        text += f", rows {found['rows']}"
    return text + ("" if found.get("input_finite", True) else " (its input was already non-finite)")


def agreement(replayed: dict[str, Any], in_loop: dict[str, Any] | None) -> bool | None:
    """Whether the replay names the same module, micro-batch and rows as the in-loop diagnosis (`None`: the run
    recorded none to compare with)."""
    if not in_loop or not in_loop.get("module"):
        return None
    keys = ("module", "micro_batch", "rows")
    return all(replayed.get(k) == in_loop.get(k) for k in keys if k in in_loop)


def report_lines(result: Replayed) -> list[str]:
    """The lines printed for one replay."""
    meta = result.meta
    lines = [
        f"Replay of step {result.step} ({', '.join(meta.get('events', [])) or '?'}; {meta.get('trainer_class')}) "
        f"from {os.path.basename(result.checkpoint)} on the CPU",
    ]
    if meta.get("left_out"):
        lines.append(f"left out of the bundle (over `nan_replay_max_bytes`): {', '.join(meta['left_out'])}")
    lines.append("non-finite state written over the checkpoint: " + (", ".join(result.overlaid) or "none"))
    if result.rearmed:
        faults = ", ".join(_fault(f) for f in result.rearmed)
        lines.append(f"re-armed test faults: {faults} (the run's FaultInjector, a test tool, fired them at this "
                     "step; not a fault of the model or the data)")  # fmt: skip
    if not result.forward:
        lines += [entry_line(name, entry) for name, entry in sorted(result.state.items())]
    moments = meta.get("nonfinite_optimizer_state") or {}
    if moments:
        listed = ", ".join(f"{name} ({e['nonfinite']} of {math.prod(e['shape'])}, {e['nan']} NaN)"
                           for name, e in moments.items())  # fmt: skip
        lines.append(f"non-finite optimizer state (not in the bundle: a forward does not read it): {listed}")
    for fault in result.not_rearmed:
        why = _why_not(fault["kind"]) if result.forward else "no forward runs: nothing to re-arm it for"
        lines.append(f"test fault not re-armed: {_fault(fault)} ({why})")
    if not result.forward:
        lines.append(f"nothing to replay forward: {result.found.get('reason')}")
        return lines
    lines.append(f"replay:  first non-finite module: {where(result.found)}")
    in_loop = meta.get("in_loop_diagnosis")
    lines.append(f"in-loop: first non-finite module: {where(in_loop)}")
    agreed = agreement(result.found, in_loop)
    verdict = {True: "yes", False: "NO", None: "nothing to compare (the run did not diagnose this step)"}[agreed]
    lines.append(f"agrees with the in-loop diagnosis: {verdict}")
    return lines


def entry_line(name: str, entry: dict[str, Any], shown: int = 8) -> str:
    """One non-finite state entry of a bundle in words: `name ([64, 64] float32): 1 of 4096 (1 NaN, 0 Inf) at flat
    indices [0]` (the first `shown` indices)."""
    values, index = entry["value"], entry["index"].tolist()
    total = math.prod(entry["shape"])
    nan = int(values.isnan().sum())
    more = f" (and {len(index) - shown} more)" if len(index) > shown else ""
    shard = "; this rank's shard, not written: the replay's model is whole" if entry.get("shard") else ""
    return (f"non-finite entries of {name} ({list(entry['shape'])} {entry['dtype']}): {len(index)} of {total} "
            f"({nan} NaN, {len(index) - nan} Inf) at flat indices {index[:shown]}{more}{shard}")  # fmt: skip


def _fault(fault: dict[str, Any]) -> str:
    extra = f", micro_batch={fault['micro_batch']}" if fault.get("micro_batch") is not None else ""
    return f"Fault(step={fault['step']}, kind={fault['kind']!r}{extra})"


def _why_not(kind: str) -> str:
    if kind in ("weight", "frozen", "update"):
        return "it wrote the state: replayed from the non-finite entries it left"
    return "it acts on the backward pass or scales a finite loss: no forward shows it"


__all__ = ["agreement", "entry_line", "report_lines", "where"]
