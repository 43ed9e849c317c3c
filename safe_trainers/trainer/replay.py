"""The diagnosis replay: a faulted step's micro-batches run again through the trainer's own `compute_loss`, with
forward hooks naming the first module whose output went non-finite (`guard/diagnosis.py`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from ..guard import localize
from ..runtime.collectives import distributed
from ..runtime.sharding import reshard


def diagnose(trainer: Any, batches: list[Any], step: int | None) -> dict[str, Any]:
    """Replay one step's micro-batches through `trainer.compute_loss` on every rank ([`localize`]) and return the
    finding of the rank where the forward pass went non-finite. The replay is not training: its inputs are not kept
    for diagnosis, and what TRL's `compute_loss` records besides the loss (per-step metrics, token counters) is put
    back afterwards, as are the random generators its forward draws from (dropout): the run trains on as if no
    replay had run."""
    model = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model
    saved = {n: copy.deepcopy(getattr(trainer, n)) for n in _REPLAY_SENSITIVE if hasattr(trainer, n)}
    trainer.safe_run.hooks.replaying = True
    try:
        with torch.random.fork_rng(**_rng_devices(trainer.args.device)):
            result = localize(trainer.model, batches, lambda b: trainer.compute_loss(model, b), trainer.args.device)
    finally:
        trainer.safe_run.hooks.replaying = False
        for name, value in saved.items():
            setattr(trainer, name, value)
        reshard(trainer.model)  # FSDP2: a forward without backward leaves the root's parameters gathered
    result["rank"] = trainer.args.process_index
    if distributed():
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        with_batch = next((r for r in results if "micro_batch" in r), results[0])
        result = next((r for r in results if r.get("module")), with_batch)
    result["step"] = step
    return result


def _rng_devices(device: torch.device) -> dict[str, Any]:
    """`fork_rng`'s arguments that save and restore the CPU generator and the one of `device` (none more: forking
    every visible accelerator's would touch devices this process does not use)."""
    if device.type == "cpu":
        return {"devices": []}
    return {"devices": [device.index if device.index is not None else 0], "device_type": device.type}


# What TRL's `compute_loss` changes besides the loss, put back after a replay (docs/design/upstream.md): the logged
# metrics and token count of every trainer, and GRPO's adaptive entropy controller (TRL 1.8+: it steps on each loss
# computed at an optimizer-step boundary, so a replay would move the coefficient of the next steps). The completion
# table (`_logs`, once `_textual_logs`) is written by generation only, which a replay does not run.
_REPLAY_SENSITIVE = ("_metrics", "_total_train_tokens", "entropy_coef", "_last_world_entropy", "_entropy_window_stats")


__all__ = ["diagnose"]
