"""The distributed backends the NaN guard protects: single process, DDP, DeepSpeed ZeRO 1-3, and FSDP2.

A backend the guard cannot protect is refused when the trainer is built, never left to train silently unprotected.
"""

from __future__ import annotations

from typing import Any

FSDP1_REFUSED = (
    "`nan_guard=True` protects FSDP version 2 (`fully_shard`), got FSDP version 1. Use FSDP2, TRL's recommended "
    "multi-GPU setup: `fsdp_config={'version': 2}` (or `fsdp_version: 2` in the accelerate config, e.g. "
    "`configs/accelerate/fsdp2.yaml`), or set `nan_guard=False` to train without the guard."
)


def backend_problem(fsdp_version: int | None) -> str | None:
    """Why the guard cannot protect this backend, or `None` when it can. `fsdp_version`: the FSDP plugin's version,
    `None` without FSDP.

    FSDP version 1 flattens parameters into per-rank `FlatParameter`s that the guard does not snapshot; FSDP2
    (`fully_shard`, DTensor parameters) is supported.
    """
    return FSDP1_REFUSED if fsdp_version == 1 else None


def refuse_unsupported_backend(trainer: Any) -> None:
    """Raise a `ValueError` when [`backend_problem`] finds one for the built trainer."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    problem = backend_problem(getattr(plugin, "fsdp_version", 2) if plugin is not None else None)
    if problem is not None:
        raise ValueError(problem)


__all__ = ["backend_problem", "refuse_unsupported_backend"]
