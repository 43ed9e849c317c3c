"""Which steps of an inspection get a replay bundle, and with which micro-batches (docs/replay.md). The guard hands
them to the caller in [`Judged.bundles`]; the caller writes them (`trainer/replay_bundles.py`) before any restore."""

from __future__ import annotations

from typing import Any

from .diagnosis import RecentBatches
from .policy import bundled_steps, state_check_step
from .port import Judged


def bundles_for(judged: Judged, batches: RecentBatches) -> tuple[dict[int, list[Any]], set[int]]:
    """The micro-batches of each step of `judged` that gets a bundle, and which of those steps were poisoned.

    The faulted steps ([`bundled_steps`]) whose micro-batches the guard still holds get them. A rollback that the
    check of the state found with no faulted step ([`state_check_step`]: GRPO/RLOO's check before a generation) gets
    a bundle at the step it was found at, with no micro-batches: the steps before it were inspected (their batches
    dropped) with a finite loss, and which step damaged the state is unknown, so no step's batches would replay it.
    """
    kept, dropped = batches.bundles(bundled_steps(judged.verdict))
    found = state_check_step(judged.verdict, judged.step) if judged.step is not None else None
    if found is not None:
        kept.setdefault(found, [])
    return kept, dropped


__all__ = ["bundles_for"]
