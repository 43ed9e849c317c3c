"""The last good state a rollback goes back to: what both of its sources hold, and the interface they share.

Two sources keep it: [`HostSnapshot`] (`memory.py`: a copy in host memory, `nan_rollback_from="memory"`) and
[`CheckpointSource`] (`checkpoint.py`: the newest verified checkpoint on disk, `"checkpoint"`). The guard holds one
of them as a [`RollbackSource`] and calls nothing else on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..backends import Backend

# The trainer's best-model bookkeeping, which goes back with the weights it describes.
BEST_MODEL_FIELDS = ("best_metric", "best_global_step", "best_model_checkpoint")


@dataclass
class Snapshot:
    """The last good training state (see `rollback/memory.py`). `step` is the optimizer step it was taken after.

    `placements` records, for each optimizer state tensor `(parameter index, key)`, the device it was copied from and
    whether it was a `DTensor`: a restore that finds no live tensor to copy into recreates it there. A source that
    keeps the state on disk fills in `step` only.
    """

    step: int = -1
    counters: dict[str, Any] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    placements: dict[tuple[int, str], tuple[torch.device, bool]] = field(default_factory=dict)
    deepspeed_state: Any = None
    ready: Any = None  # a CUDA event recorded after the copies were queued (on their side stream, if any)
    restored_at: int = -1  # the step at which a rollback last put this state back (the live state is then this one)

    @property
    def taken(self) -> bool:
        return self.step >= 0

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


@runtime_checkable
class RollbackSource(Protocol):
    """Where the guard's last good state is kept, and how it comes back.

    Attributes:
        backend ([`Backend`]): what the guard bound to when training started (the optimizer, the ZeRO stage).
        checkpoints (`list[str]`): this run's verified checkpoints (and the one it resumed from), oldest first: where a
            damaged parameter that the source does not hold (a frozen one) is restored from.
        may_load (`bool`): whether a rollback may load a checkpoint, which may find no good state left (an abort):
            the inspection's events are then recorded before [`to_load`] decides.
    """

    backend: Backend
    checkpoints: list[str]
    may_load: bool

    def take(self, state: Any) -> Snapshot:
        """Keep the current weights and optimizer state as the last good state (`state`: the `TrainerState`)."""

    def copy_delay_seconds(self) -> float | None:
        """The seconds the last [`take`]'s device copies delayed training beyond the host time spent in `take`
        (copies queued on a GPU), for the snapshot interval's budget (`guard/snapshot_interval.py`); `None` when not
        known yet."""

    def allocation_seconds(self) -> float:
        """The host seconds the last [`take`] spent allocating its host buffers (a one-time cost, not counted as the
        snapshot's: `guard/snapshot_interval.py`); `0.0` when it reused them."""

    def needs_checkpoint(self, step: int) -> bool:
        """Whether the good state of `step` must be published as a checkpoint before it can be gone back to."""

    def published(self, path: str) -> None:
        """The trainer published a verified checkpoint of this run at `path`."""

    def to_load(self, step: int) -> str | None:
        """The checkpoint the caller loads before [`restore`] (the disk source), or `None`."""

    def refresh_best_fields(self, state: Any) -> None:
        """Record the best-model fields of `state` as they are now, for the weights already kept."""

    def before_write(self) -> None:
        """The weights or the optimizer state are about to be written (the optimizer step, a load): what still reads
        them for the last good state (a snapshot's copies in flight) finishes first, on the device."""

    def restore(self, state: Any) -> Snapshot:
        """Put the last good weights, optimizer state and best-model fields back (after the caller loaded
        [`to_load`]'s checkpoint, if any); the optimizer's hyperparameters and `state`'s timeline (`global_step`, the
        LR schedule) stay as they are."""


def rollback_source(settings: Any, args: Any, report: Any = None) -> tuple[str, str | None]:
    """Where the guard keeps its last good state (`"memory"` or `"checkpoint"`): the guard's settings
    (`trainer.safety_settings.nan_rollback_from`, which a rule may have changed, e.g. `memory.snapshot_fits`), and a
    note when that differs from the config (`args.nan_rollback_from`), naming the rule that changed it."""
    chosen, configured = settings.nan_rollback_from, getattr(args, "nan_rollback_from", settings.nan_rollback_from)
    if chosen == configured:
        return chosen, None
    path = "safety_settings.nan_rollback_from"
    findings = getattr(report, "findings", ()) or ()
    rules = [f.rule_id for f in findings if f.action == "fixed" and any(c.path == path for c in f.changes)]
    by = f"the `{rules[-1]}` rule" if rules else "the guard's settings"
    return chosen, (
        f"NaN guard: rolls back from {chosen} (`nan_rollback_from={chosen!r}`, set by {by}) while the config says "
        f"`nan_rollback_from={configured!r}`; see the safety report. Disable the rule with `safety_disable_rules` to "
        "keep the configured source."
    )


def best_model_fields(state: Any) -> dict[str, Any]:
    """The best-model fields of a `TrainerState`, as they are now."""
    return {key: getattr(state, key) for key in BEST_MODEL_FIELDS if hasattr(state, key)}


def param_groups(optimizer: Any) -> list[dict]:
    """The optimizer's parameter groups (none for an object that has none)."""
    return list(getattr(optimizer, "param_groups", []))


@contextmanager
def kept_hyperparameters(optimizer: Any) -> Iterator[None]:
    """Whatever a restore inside loads, the optimizer's hyperparameters (learning rate, betas, ...) come out as they
    went in: the LR follows the schedule position, which a rollback does not rewind."""
    live = [{key: value for key, value in group.items() if key != "params"} for group in param_groups(optimizer)]
    yield
    for group, kept in zip(param_groups(optimizer), live):
        group.update(kept)


__all__ = [
    "BEST_MODEL_FIELDS", "RollbackSource", "Snapshot", "best_model_fields", "kept_hyperparameters", "param_groups",
    "rollback_source",
]  # fmt: skip
