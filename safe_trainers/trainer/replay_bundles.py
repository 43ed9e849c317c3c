"""Replay bundles taken from a trainer at an inspection that found a fault (docs/replay.md): each faulted step's
micro-batches, the state entries found non-finite, GRPO/RLOO's rewards and the test faults that fired, written to
`output_dir/nan_replay/step-N/` (`replay/bundle.py`) before anything is restored.

Who writes: the main process always, with the meta and the config; every other rank only for a step whose loss was
non-finite on that rank, or whose in-loop diagnosis found the module on that rank (a damaged state every rank
shares, a finite loss: the rows that show it may be another rank's), each rank its own rows, state entries and
fired test faults (the meta's are the main process's). A failure to write is logged, never raised: a bundle is a
diagnostic.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from typing import Any

import torch

from ..guard import Judged
from ..redact import hide_in_text, mask_secret
from ..replay.bundle import fit, rotate_bundles, write_bundle
from ..replay.rerun import checkpoint_before
from ..runtime.nested import map_tensors
from ..runtime.sharding import is_sharded, local

logger = logging.getLogger("safe_trainers")


def write_bundles(trainer: Any, judged: Judged, diagnosis: dict | None) -> None:
    """Write the bundle of every faulted step of `judged` (its `bundles`) that this process writes, then rotate."""
    if not judged.bundles:
        return
    try:
        _write(trainer, judged, diagnosis)
    except Exception as error:  # a diagnostic: never let it break training
        logger.warning(f"NaN guard: the replay bundle(s) of step(s) {sorted(judged.bundles)} were not written: {error}")


def _write(trainer: Any, judged: Judged, diagnosis: dict | None) -> None:
    args, settings = trainer.args, trainer.safety_settings
    rank, main = args.process_index, trainer.is_world_process_zero()
    records = {r.step: r for r in judged.records}
    state = nonfinite_entries(trainer.model) if not judged.state_finite else {}
    for step, batches in judged.bundles.items():
        record = records.get(step)
        bad_ranks = sorted(record.bad_ranks) if record is not None else []
        in_loop = diagnosis if diagnosis is not None and diagnosis.get("step") == step else None
        found_on = in_loop.get("rank") if in_loop is not None and in_loop.get("module") else None
        if not main and rank not in bad_ranks and rank != found_on:  # each rank its own rows, where they went bad
            continue
        items = [(f"micro_batch.{i}", host_copy(b)) for i, b in enumerate(batches)]
        items += [("rewards", host_copy(r)) for r in [_rewards(trainer)] if r is not None]
        items += [(f"state.{name}", entry) for name, entry in state.items()]
        kept, sizes, left_out = fit(items, settings.nan_replay_max_bytes)
        payload = {
            "micro_batches": {int(n.split(".")[1]): v for n, v in kept.items() if n.startswith("micro_batch.")},
            "state": {n[len("state."):]: v for n, v in kept.items() if n.startswith("state.")},
            "rewards": kept.get("rewards"),
            "faults": fired_faults(trainer, step, rank),  # this rank's: a fault may fire on one rank only
        }
        meta = None
        if main:
            meta = {
                "step": step, "events": events_of(judged, step), "ranks": bad_ranks,
                "kind": trainer._safety_kind, "trainer_class": type(trainer).__name__,
                "checkpoint": _name(checkpoint_before(args.output_dir, step)),
                "micro_batches": len(batches), "prepared": step not in judged.dropped,
                "max_bytes": settings.nan_replay_max_bytes, "bytes": sizes, "left_out": left_out,
                "in_loop_diagnosis": in_loop, "nonfinite_state": sorted(state),
                "faults": fired_faults(trainer, step, rank),
                "reward_funcs": list(getattr(trainer, "reward_func_names", []) or []),
            }  # fmt: skip
        write_bundle(args.output_dir, step, rank, payload, meta, config_record(args) if main else None)
    if main:
        rotate_bundles(args.output_dir, max(judged.bundles), settings.nan_replay_limit)


def host_copy(value: Any) -> Any:
    """A compact host copy of every tensor (the diagnosis's copies are views of shared host buffers, which
    `torch.save` would write whole)."""
    return map_tensors(value, lambda t: t.detach().to("cpu", copy=True).contiguous())


def nonfinite_entries(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """The parameters and buffers of `model` holding NaN or Inf: for each, its shape, dtype and the flat indices and
    values of its non-finite entries (what a replay writes over the checkpoint's weights). A sharded parameter
    (FSDP2) is read as this rank's shard, its indices into that shard (`"shard": true`)."""
    found = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_floating_point():
            continue
        data = local(tensor.detach())
        bad = ~torch.isfinite(data)
        if not bool(bad.any()):
            continue
        index = bad.reshape(-1).nonzero().flatten()
        found[name] = {
            "shape": list(data.shape),
            "dtype": str(data.dtype).removeprefix("torch."),
            "index": index.cpu(),
            "value": data.reshape(-1)[index].float().cpu(),
            "shard": is_sharded(tensor),
        }
    return found


def events_of(judged: Judged, step: int) -> list[str]:
    """The events step `step` has from this inspection: `skip` (a poisoned step's also `poison`), `rollback`."""
    verdict = judged.verdict
    kinds = ["skip"] if any(r.step == step for r in verdict.skipped) else []
    kinds += ["poison"] if step in judged.dropped else []
    return kinds + (["rollback"] if verdict.rollback is not None and verdict.fault_step == step else [])


def fired_faults(trainer: Any, step: int, rank: int) -> list[dict[str, Any]]:
    """The test tool's faults (`testing/faults.py`) that fired at `step` on this rank, as data (`value` as text: JSON
    has no NaN); `[]` without a `FaultInjector`."""
    injector = getattr(trainer, "fault_injector", None)
    if injector is None:
        return []
    fired = {kind for s, kind in injector.injected if s == step}
    return [
        {**asdict(fault), "value": repr(fault.value)}
        for fault in injector.faults
        if fault.hits(step, rank) and fault.kind in fired
    ]


def _name(path: str | None) -> str | None:
    return os.path.basename(path) if path is not None else None


def _rewards(trainer: Any) -> torch.Tensor | None:
    """GRPO/RLOO: the rewards of the last generation (one row per completion, one column per reward function)."""
    return getattr(trainer, "replay_rewards", None)


def config_record(args: Any) -> dict[str, Any]:
    """The trainer's config as `to_dict()` writes it, with the special tokens it masks put back and every value
    whose name or shape says it is a credential hidden, and a known token's shape inside any text (a `run_name`
    that quotes one) too (`redact.py`)."""
    record = args.to_dict()
    for name in record:
        if name.endswith("_token") and name != "hub_token" and isinstance(getattr(args, name, None), (str, type(None))):
            record[name] = getattr(args, name)
    masked = {name: mask_secret(name, value) for name, value in record.items()}
    return map_tensors(masked, lambda t: t, lambda leaf: hide_in_text(leaf) if isinstance(leaf, str) else leaf)


__all__ = ["config_record", "nonfinite_entries", "write_bundles"]
