"""The run's event log: one JSON object per line in `output_dir/nan_events.jsonl` (the name it has always had: the
guard's skips and rollbacks, and the resumes, poisoned steps, preemptions and hangs of the run that outlives them)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .files import open_append_no_follow, write_text_no_follow

EventKind = Literal[
    "skip", "overflow", "rollback", "abort", "reward", "save_refused", "restore", "resume", "poison", "preempt",
    "spike", "hang", "snapshot_interval", "shard_missing", "collapse",
]
EVENTS_FILE = "nan_events.jsonl"
# The longest line of the event log read (an event is a few hundred bytes; a `resume` event with many passed-over
# checkpoints a few KB): a longer one is not an event this product wrote, and is skipped.
EVENT_LINE_LIMIT = 1 * 2**20
logger = logging.getLogger("safe_trainers")


@dataclass
class RunEvent:
    """One event.

    Args:
        step (`int`): the optimizer step the event is about.
        kind (`str`): `"skip"` (an update was not applied), `"overflow"` (the fp16 loss scaler skipped a step and
            lowered its scale: not a fault), `"rollback"` (the last good state was restored),
            `"abort"` (training stopped with [`TrainingDivergedError`]), `"reward"` (GRPO rewards were non-finite),
            `"save_refused"` (a checkpoint was not written because the state was non-finite), `"restore"` (after
            training ended, the last good state was put back over a state damaged after the last check), `"resume"`
            (the run resumed, or was restarted by the elastic agent: from which checkpoint, which newer ones were
            passed over and why, which earlier processes died where), `"poison"` (a step's batches killed the
            process several times in a row and are skipped: which micro-batches, which attempts died), `"preempt"`
            (a preemption signal: which ranks received it, and the step of the checkpoint published before exiting),
            `"spike"` (the step's loss or gradient norm spiked far above the recent steps': its update was skipped),
            `"hang"` (a step ran past the hang bound: the seconds, the bound, the stacks file, whether the process
            exited; `relayed_from`: the rank whose watchdog saw it, when that is not the main process,
            `restarts/hang_relay.py`), `"snapshot_interval"` (the guard chose how many steps apart its snapshots
            are, from the measured `snapshot_seconds` and `step_seconds`, the `budget` and the bounds: not a fault),
            `"shard_missing"` (a rollback found a rank without its shard of the host snapshot, which DDP
            ranks share out: it loads the newest verified checkpoint instead), `"collapse"` (GRPO/RLOO: a metric TRL
            computes, e.g. the entropy or the rewards' spread, crossed its threshold against the run's recent steps
            for a streak of `collapse_patience` steps or more: `signal`, `metric`, `value`, the window's `median` and
            `scale`, `threshold`, `direction`, `window`, `patience`, `streak`; warn-only, training is unchanged).
        nonfinite (`list[str]`): what was non-finite: `"loss"`, `"grad_norm"`, `"weights"`, `"optimizer_state"`,
            `"rewards"`, `"advantages"`.
        ranks (`list[int]`): the ranks where the loss was non-finite (all ranks see a non-finite gradient norm).
        detail (`dict`): kind-specific fields (`restored_step`, `skipped_batches`, `learning_rate`,
            `first_nonfinite_module`, `reason`, ...).
    """

    step: int
    kind: EventKind
    nonfinite: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {"step": self.step, "kind": self.kind, "nonfinite": self.nonfinite, "ranks": self.ranks}
        out.update(self.detail)
        out["time"] = round(time.time(), 3)
        return _finite_json(out)


class EventLog:
    """Keeps the events of one run in memory and appends them to `nan_events.jsonl` (main process only), then hands
    each to the `observers` (e.g. the reporting to TensorBoard and W&B, `trainer/reporting.py`), whichever module
    added it; an observer that raises is logged and the run goes on."""

    def __init__(self, output_dir: str, write: bool):
        self.path = os.path.join(output_dir, EVENTS_FILE)
        self.write = write
        self.events: list[RunEvent] = []
        self.observers: list[Callable[[RunEvent], None]] = []

    def start_run(self, resumed_at: int | None) -> str | None:
        """Begin a run. A new run (`resumed_at=None`) starts its own log and keeps the previous run's as
        `nan_events.previous-<n>.jsonl`; a run resumed from the checkpoint of step `resumed_at` appends to the log,
        which keeps only the events up to that step (later ones belong to the timeline the resume abandons; the full
        log is kept as a previous one then). Returns the name of the kept log, if one was kept."""
        self.events = []
        if not self.write or not os.path.exists(self.path):
            return None
        if resumed_at is not None:
            lines = _lines(self.path)
            kept = [line for line, event in lines if event is not None and event.get("step", 0) <= resumed_at]
            if len(kept) == len(lines):
                return None
        stem, ext = os.path.splitext(self.path)
        n = 1
        while os.path.exists(f"{stem}.previous-{n}{ext}"):
            n += 1
        previous = f"{stem}.previous-{n}{ext}"
        os.replace(self.path, previous)
        if resumed_at is not None:
            write_text_no_follow(self.path, "".join(kept))
        return previous

    def add(self, event: RunEvent) -> RunEvent:
        self.events.append(event)
        if self.write:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open_append_no_follow(self.path) as f:  # a link there is refused (`runtime/files.py`)
                f.write(json.dumps(event.to_dict()) + "\n")
        for observer in self.observers:
            try:
                observer(event)
            except Exception as error:  # reporting an event never stops the run that recorded it
                logger.warning(f"NaN guard: the `{event.kind}` event of step {event.step} was not reported: {error!r}")
        return event


def read_events(output_dir: str) -> list[dict[str, Any]]:
    """The events recorded in `output_dir/nan_events.jsonl` (empty if none); a line that is not an event (does not
    parse, is not an object with an integer `step`, is over `EVENT_LINE_LIMIT` bytes) is skipped with a warning."""
    return read_event_file(os.path.join(output_dir, EVENTS_FILE))


def read_event_file(path: str) -> list[dict[str, Any]]:
    """The events of one event log file (the run's, or a kept `nan_events.previous-<n>.jsonl`), as [`read_events`]."""
    if not os.path.exists(path):
        return []
    return [event for _, event in _lines(path) if event is not None]


def _lines(path: str) -> list[tuple[str, dict[str, Any] | None]]:
    """Each non-blank line of the event log at `path`, with its event (`None`: not an event, warned about), reading
    at most `EVENT_LINE_LIMIT` bytes of a line at a time."""
    out: list[tuple[str, dict[str, Any] | None]] = []
    with open(path, "rb") as f:
        while raw := f.readline(EVENT_LINE_LIMIT + 1):
            if len(raw) > EVENT_LINE_LIMIT and not raw.endswith(b"\n"):
                while (rest := f.readline(EVENT_LINE_LIMIT + 1)) and not rest.endswith(b"\n"):
                    pass  # the rest of a line too long to be an event
                out.append(("", _not_an_event(path, len(out) + 1, f"over {EVENT_LINE_LIMIT} bytes")))
                continue
            line = raw.decode("utf-8", "replace")
            if line.strip():
                out.append((line if line.endswith("\n") else line + "\n", _event(path, len(out) + 1, line)))
    return out


def _event(path: str, number: int, line: str) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep to parse
        return _not_an_event(path, number, f"does not parse ({type(error).__name__}: {error})")
    if not isinstance(event, dict) or type(event.get("step", 0)) is not int:
        return _not_an_event(path, number, "is not an object with an integer `step`")
    return event


def _not_an_event(path: str, number: int, why: str) -> None:
    logger.warning(f"NaN guard: line {number} of `{path}` {why}; it is skipped (the log's other events are read).")
    return None


def _finite_json(value: Any) -> Any:
    """JSON has no NaN: non-finite floats are written as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value
