"""The goodput of a run: the time spent in optimizer steps that count (their update is in the final weights) over the
wall time from the first process's start to the last one's last record, restarts and their gaps included.

Each process of the run is a [`Span`] (from the step record: the earlier processes' spans and the writing
one's). A process's steps after the earliest step a later process resumed at are redone, and steps whose update the
guard did not apply (`skip`, `spike`, `poison`) or threw away (a rollback's `discarded_steps`) do not count; each
costs the process's mean step time, since the record keeps the sum of its step times, not each one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..restarts.progress import Progress, Span

# Events whose step's update is not in the weights; a rollback lists the applied steps it threw away.
NOT_APPLIED = ("skip", "spike", "poison")


@dataclass(frozen=True)
class Goodput:
    """The run's time, in seconds.

    Args:
        wall (`float`): from the first process's start to the last record.
        in_steps (`float`): inside optimizer steps, every process.
        productive (`float`): inside the steps that count.
        redone_steps (`int`): steps run again after a restart (the dead process's work past its checkpoint).
        not_applied_steps (`int`): steps whose update the guard skipped or rolled back.
        gaps (`list[float]`): the wall time between each process's last record and the next one's start.
    """

    wall: float
    in_steps: float
    productive: float
    redone_steps: int
    not_applied_steps: int
    gaps: list[float]

    @property
    def ratio(self) -> float | None:
        """Productive step time over wall time, or `None` when no wall time is known."""
        return self.productive / self.wall if self.wall > 0 else None


def process_spans(record: Progress | None) -> list[Span]:
    """Every process of the run the step record knows of, in order (none for a record of an older version)."""
    if record is None:
        return []
    history = record.history
    spans = list(history.spans)
    if history.began is not None:
        inside = record.phase in ("step", "compile")  # a step still running (or compiling) has not counted
        last = record.step - 1 if inside else record.step
        spans.append(
            Span(history.attempt, history.began, record.time, history.first_step, max(last, history.first_step),
                 record.step_seconds, record.finished)  # fmt: skip
        )
    return spans


def goodput(spans: list[Span], events: list[dict[str, Any]]) -> Goodput:
    """The run's [`Goodput`] from its processes and its events (see the module docstring)."""
    spans = worked(spans)
    if not spans:
        return Goodput(0.0, 0.0, 0.0, 0, 0, [])
    lost = _not_applied(events)
    productive, redone = 0.0, 0
    for index, span in enumerate(spans):  # a later process that resumed earlier redid this one's steps past there
        kept_until = min([span.last_step] + [later.first_step for later in spans[index + 1 :]])
        kept = max(kept_until - span.first_step, 0)
        redone += span.steps - kept
        counted = kept - sum(1 for step in lost if span.first_step < step <= kept_until)
        productive += max(counted, 0) * span.mean_step
    return Goodput(
        wall=max(s.ended for s in spans) - min(s.began for s in spans),
        in_steps=sum(s.step_seconds for s in spans),
        productive=productive,
        redone_steps=redone,
        not_applied_steps=len(lost),
        gaps=[after.began - span.ended for span, after in zip(spans, spans[1:])],
    )


def worked(spans: list[Span]) -> list[Span]:
    """The processes that belong to the run's time: a process that trained no step after the run finished (the
    script restarted for a later `train()` call, or a finished run launched again) is not the run's."""
    done = next((i for i, span in enumerate(spans) if span.finished), None)
    if done is None:
        return spans
    return spans[: done + 1] + [span for span in spans[done + 1 :] if span.steps > 0]


def _not_applied(events: list[dict[str, Any]]) -> set[int]:
    steps = {e["step"] for e in events if e.get("kind") in NOT_APPLIED and not _trained_anyway(e)}
    for event in events:
        if event.get("kind") == "rollback":
            steps.update(s for s in event.get("discarded_steps", []) if isinstance(s, int))
    return steps


def _trained_anyway(event: dict[str, Any]) -> bool:
    return event.get("kind") == "poison" and event.get("skipped") is False  # a step that could not be left out


__all__ = ["NOT_APPLIED", "Goodput", "goodput", "process_spans", "worked"]
