"""Replay bundles taken from a trainer at an inspection that found a fault (docs/replay.md): each faulted step's
micro-batches, the state entries found non-finite, GRPO/RLOO's rewards and the test faults that fired, written to
`output_dir/nan_replay/step-N/` (`replay/bundle.py`) before anything is restored.

Who writes: the main process always, with the meta and the config; every other rank only for a step whose loss was
non-finite on that rank, or whose in-loop diagnosis found the module on that rank (a damaged state every rank
shares, a finite loss: the rows that show it may be another rank's), or, for a rollback the check of the state found
with no faulted step, whose state was found non-finite there; each rank its own rows, state entries and fired test
faults (the meta's are the main process's). A failure to write is logged, never raised: a bundle is a diagnostic.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from typing import Any

import torch

from ..guard import Judged, state_check_step, unwrap_optimizer
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
    moments = nonfinite_optimizer_state(trainer.model, trainer.optimizer) if not judged.state_finite else {}
    checked = state_check_step(judged.verdict, judged.step) if judged.step is not None else None
    for step, batches in judged.bundles.items():
        record = records.get(step)
        bad_ranks = sorted(record.bad_ranks) if record is not None else []
        in_loop = diagnosis if diagnosis is not None and diagnosis.get("step") == step else None
        found_on = in_loop.get("rank") if in_loop is not None and in_loop.get("module") else None
        damaged = list(trainer.safe_run.guard.damaged_ranks) if step == checked else []
        if not main and rank not in bad_ranks and rank != found_on and rank not in damaged:  # each rank its own
            continue
        fault_steps = (step, step + 1) if step == checked else (step,)
        items = [(f"micro_batch.{i}", host_copy(b)) for i, b in enumerate(batches)]
        items += [("rewards", host_copy(r)) for r in [_rewards(trainer)] if r is not None]
        items += [(f"state.{name}", entry) for name, entry in state.items()]
        kept, sizes, left_out = fit(items, settings.nan_replay_max_bytes)
        payload = {
            "micro_batches": {int(n.split(".")[1]): v for n, v in kept.items() if n.startswith("micro_batch.")},
            "state": {n[len("state."):]: v for n, v in kept.items() if n.startswith("state.")},
            "rewards": kept.get("rewards"),
            "faults": fired_faults(trainer, fault_steps, rank),  # this rank's: a fault may fire on one rank only
            "optimizer_state": moments,  # named and counted only: a forward does not read it
        }
        meta = None
        if main:
            meta = {
                "step": step, "events": events_of(judged, step), "ranks": bad_ranks,
                "kind": trainer._safety_kind, "trainer_class": type(trainer).__name__,
                "checkpoint": _name(checkpoint_before(args.output_dir, step)),
                "micro_batches": len(batches), "prepared": step not in judged.dropped,
                "max_bytes": settings.nan_replay_max_bytes, "bytes": sizes, "left_out": left_out,
                "in_loop_diagnosis": in_loop, "nonfinite_state": sorted(state), "nonfinite_optimizer_state": moments,
                "faults": fired_faults(trainer, fault_steps, rank),
                "reward_funcs": list(getattr(trainer, "reward_func_names", []) or []),
            }  # fmt: skip
            if step == checked:
                meta.update(state_check_meta(damaged))
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


def nonfinite_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict[str, dict[str, Any]]:
    """The optimizer state entries (a torch optimizer's per-parameter state: Adam's `exp_avg`, `exp_avg_sq`) holding
    NaN or Inf, as `"<parameter name>:<key>"`: its shape, dtype and how many entries are non-finite (`nonfinite`), of
    them NaN (`nan`). Named and counted only, not kept: a replay's forward does not read the optimizer state. A
    parameter the model does not name (a DeepSpeed ZeRO partition, flat) is passed over."""
    names = {id(p): name for name, p in model.named_parameters()}
    found = {}
    for param, slots in getattr(unwrap_optimizer(optimizer), "state", {}).items():
        for key, value in slots.items():
            if id(param) not in names or not torch.is_tensor(value) or not value.is_floating_point():
                continue
            data = local(value.detach())
            bad = ~torch.isfinite(data)
            count = int(bad.sum())
            if count:
                found[f"{names[id(param)]}:{key}"] = {
                    "shape": list(data.shape), "dtype": str(data.dtype).removeprefix("torch."),
                    "nonfinite": count, "nan": int(data.isnan().sum()),
                }  # fmt: skip
    return dict(sorted(found.items()))


def events_of(judged: Judged, step: int) -> list[str]:
    """The events step `step` has from this inspection: `skip` (a poisoned step's also `poison`), `rollback` (at its
    fault step, or, found by the check of the state with no faulted step, at the step it was found at)."""
    verdict = judged.verdict
    kinds = ["skip"] if any(r.step == step for r in verdict.skipped) else []
    kinds += ["poison"] if step in judged.dropped else []
    checked = state_check_step(verdict, judged.step) if judged.step is not None else None
    rolled_back = verdict.rollback is not None and step in (verdict.fault_step, checked)
    return kinds + (["rollback"] if rolled_back else [])


def state_check_meta(damaged_ranks: list[int]) -> dict[str, Any]:
    """What `meta.json` adds for a rollback the check of the state found with no faulted step (no micro-batches)."""
    return {
        "found_by": "state_check", "fault_step": None, "damaged_ranks": sorted(damaged_ranks),
        "note": "The weights or optimizer state were found non-finite by the guard's check of the state (GRPO/RLOO: "
                "before a generation; any trainer: before a save or an evaluation, after a callback ran past the "
                "step's own check), with no step's loss or gradient non-finite since the last inspection: which "
                "step damaged them is unknown (any since the last verified state), so the bundle holds no "
                "micro-batches, only the non-finite entries, the last generation's rewards (GRPO/RLOO) and the test "
                "faults that fired at this step and at the step in progress, if any.",
    }  # fmt: skip


def fired_faults(trainer: Any, steps: tuple[int, ...], rank: int) -> list[dict[str, Any]]:
    """The test tool's faults (`testing/faults.py`) that fired at one of `steps` on this rank, as data (`value` as
    text: JSON has no NaN); `[]` without a `FaultInjector`."""
    injector = getattr(trainer, "fault_injector", None)
    if injector is None:
        return []
    fired = {(s, kind) for s, kind in injector.injected if s in steps}
    return [
        {**asdict(fault), "value": repr(fault.value)}
        for fault in injector.faults
        if any(fault.hits(s, rank) and (s, fault.kind) in fired for s in steps)
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


__all__ = ["config_record", "nonfinite_entries", "nonfinite_optimizer_state", "write_bundles"]
