"""The events of a run as markers on its timeline: which event kinds get one, their labels and colours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MarkerKind:
    """How a kind of marker is drawn: its `label` in the legend and the summary, and its `color`."""

    label: str
    color: str


# Event kinds (`runtime/events.py`) -> how their marker is drawn. `snapshot_interval` (a setting chosen, not a fault)
# gets none. A `resume` event is a `restart` marker when an earlier process of the run died or the agent restarted it.
MARKER_KINDS: dict[str, MarkerKind] = {
    "skip": MarkerKind("update skipped", "#d62728"),
    "overflow": MarkerKind("fp16 overflow", "#bcbd22"),
    "spike": MarkerKind("spike skipped", "#ff7f0e"),
    "rollback": MarkerKind("rollback", "#9467bd"),
    "abort": MarkerKind("abort", "#000000"),
    "reward": MarkerKind("non-finite reward", "#e377c2"),
    "save_refused": MarkerKind("save refused", "#8c564b"),
    "restore": MarkerKind("restored at end", "#7f7f7f"),
    "preempt": MarkerKind("preempted", "#17becf"),
    "hang": MarkerKind("hang", "#1f77b4"),
    "restart": MarkerKind("restart", "#2ca02c"),
    "resume": MarkerKind("resume", "#98df8a"),
    "poison": MarkerKind("poisoned step", "#c49c94"),
    "shard_missing": MarkerKind("snapshot shard missing", "#aec7e8"),
    "collapse": MarkerKind("collapse warning", "#dbdb8d"),
}


@dataclass(frozen=True)
class Marker:
    """One event on the timeline.

    Args:
        step (`int`): the step it is about.
        kind (`str`): a key of [`MARKER_KINDS`].
        time (`float`, *optional*): when it was recorded (seconds since the epoch).
        text (`str`): one line on what happened.
    """

    step: int
    kind: str
    time: float | None
    text: str


def marker_kind(event: dict[str, Any]) -> str | None:
    """The marker kind of an event, or `None` for an event that gets no marker."""
    kind = event.get("kind")
    if kind == "resume":
        return "restart" if event.get("restart") or event.get("deaths") else "resume"
    return kind if kind in MARKER_KINDS else None


def markers(events: list[dict[str, Any]]) -> list[Marker]:
    """The markers of a run's events, in the event log's order."""
    out = []
    for event in events:
        kind = marker_kind(event)
        if kind is not None:
            out.append(Marker(event["step"], kind, event.get("time"), describe(kind, event)))
    return out


def describe(kind: str, event: dict[str, Any]) -> str:
    """One line on an event (what failed, what the guard did)."""
    parts = [MARKER_KINDS[kind].label]
    if event.get("nonfinite"):
        parts.append("non-finite " + ", ".join(event["nonfinite"]))
    for key, say in DETAILS:
        if event.get(key) not in (None, [], ""):
            parts.append(say.format(event[key]))
    return "; ".join(parts)


# Event fields worth a word on the timeline, and how to say them.
DETAILS: tuple[tuple[str, str], ...] = (
    ("restored_step", "restored step {}"),
    ("checkpoint", "from {}"),
    ("signal", "signal {}"),
    ("seconds", "{} s"),
    ("relayed_from", "on rank {}"),  # a hang another rank's watchdog saw (`restarts/hang_relay.py`)
    ("metric", "`{}`"),
    ("value", "value {}"),
    ("threshold", "threshold {}"),
)


__all__ = ["MARKER_KINDS", "Marker", "MarkerKind", "describe", "marker_kind", "markers"]
