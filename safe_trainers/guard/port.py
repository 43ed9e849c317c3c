"""What the NaN guard reads from the training loop it guards, and what it hands back.

The guard never holds the trainer. Its doors take values (a micro-batch loss, the facts of a step's end, the
optimizer) and the few facts it reads while training runs come through a [`GuardPort`]: the integration layer
implements it over a `transformers.Trainer` (`trainer/port.py`), the unit tests over plain values. What the guard
decides that only the trainer can carry out (replay a batch, load a checkpoint, save one, drop buffered rollouts) it
returns as a [`Decision`]; the caller acts on it and calls the guard's next door. Nothing here calls back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .policy import StepReading, Verdict


class GuardPort(Protocol):
    """The loop's facts the guard reads when it needs them.

    Attributes:
        state: the loop's `TrainerState` (`global_step`, `max_steps`, the best-model fields a restore puts back).
        device (`torch.device`): where the loop's tensors live (the guard's flags go there).
        model (`torch.nn.Module`): the unwrapped model whose parameters the guard checks and restores.
        scheduler: the learning-rate scheduler (the backoff scales its base rates), or `None`.
    """

    @property
    def state(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def scheduler(self) -> Any: ...


@dataclass
class Judged:
    """An inspection read and judged, before anything is recorded or restored ([`NanGuard.judge`]).

    Args:
        records ([`StepReading`]): the pending steps, read back.
        verdict ([`Verdict`]): what the policy made of them.
        state_finite (`bool`): the weights and optimizer state were found finite (or not checked: no fault).
        replay (`list`): the micro-batches of the step to diagnose, for the caller to replay (empty: no diagnosis).
        replay_step (`int | None`): that step.
        snapshot (`bool`): the caller asked for a snapshot after an applied step.
        bundles (`dict[int, list]`): the micro-batches of each faulted step to write as a replay bundle (empty: none,
            or `nan_replay_max_bytes=0`), written by the caller before anything is restored.
        dropped (`set[int]`): the steps among them that were poisoned (batches as the dataloader gave them).
        step (`int`, *optional*): the step (`global_step`) the inspection ran at: a rollback found by the check of
            the state alone, with no faulted step, is numbered by it (`policy.state_check_step`).
    """

    records: list[StepReading]
    verdict: Verdict
    state_finite: bool
    replay: list[Any] = field(default_factory=list)
    replay_step: int | None = None
    snapshot: bool = False
    bundles: dict[int, list[Any]] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)
    step: int | None = None


@dataclass
class Decision:
    """What an inspection decided that the caller carries out ([`NanGuard.settle`]).

    Args:
        verdict ([`Verdict`]): the inspection's verdict.
        restore (`bool`): put the last good state back ([`NanGuard.restore`]), then drop what the discarded policy
            produced (GRPO/RLOO's buffered rollouts).
        load (`str | None`): before the restore, load this checkpoint's weights and optimizer state (the last good
            state kept on disk, `nan_rollback_from="checkpoint"`).
        abort (`bool`): after the restore, stop: save the restored state as a checkpoint and raise
            [`NanGuard.diverged`].
        publish_good_state (`bool`): publish the current state as a checkpoint: the disk source's first good state.
        diagnosis (`dict | None`): the diagnosis the caller replayed, kept for the rollback event.
        records ([`StepReading`]): the steps the inspection read.
        replayed (`dict | None`): the diagnosis, recorded with the window's first skip.
        recorded (`bool`): the window's events are recorded ([`NanGuard.record`]).
    """

    verdict: Verdict
    restore: bool = False
    load: str | None = None
    abort: bool = False
    publish_good_state: bool = False
    diagnosis: dict | None = None
    records: list[StepReading] = field(default_factory=list)
    replayed: dict | None = None
    recorded: bool = False


@dataclass(frozen=True)
class EndRestore:
    """Training ended with a state damaged after the last check ([`NanGuard.check_at_end`]): what the caller loads
    before [`NanGuard.restored_at_end`] (`best`: the best checkpoint, with `load_best_model_at_end`; `load`: the disk
    source's newest good checkpoint; neither: the snapshot in memory)."""

    best: str | None = None
    load: str | None = None


__all__ = ["Decision", "EndRestore", "GuardPort", "Judged"]
