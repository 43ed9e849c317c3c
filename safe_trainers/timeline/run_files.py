"""What a run wrote that its timeline reads: the Trainer's log history (`trainer_state.json`, the newest one of this
run: its own, or that of the newest checkpoint its step record lists while it runs or after it died, never an earlier
run's left in the same `output_dir`), the event log (`nan_events.jsonl`, with the hangs, preemptions and aborts of
its processes that a resume cut from it: they are in the kept `nan_events.previous-<n>.jsonl`) and the step record
(`.safe_trainers_progress.json`). Each may be missing: a run that has not saved yet has no log history, a run without
the guard no event log; the timeline shows what there is."""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..restarts.progress import Progress, read_progress
from ..runtime.events import read_event_file, read_events

TRAINER_STATE = "trainer_state.json"
# Events about a process (not a step's update) that the timeline keeps even when a resume cut them from the log.
PROCESS_KINDS = ("hang", "preempt", "abort")
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


@dataclass
class RunFiles:
    """The files of one run, read.

    Args:
        output_dir (`str`): the run's `output_dir`.
        log_history (`list[dict]`): the Trainer's log entries (each with its `step`), from `log_source`.
        log_source (`str`, *optional*): the `trainer_state.json` they came from.
        events (`list[dict]`): the event log's events, in order.
        record ([`Progress`], *optional*): the step record.
    """

    output_dir: str
    log_history: list[dict[str, Any]] = field(default_factory=list)
    log_source: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    record: Progress | None = None

    @property
    def last_step(self) -> int:
        """The newest step any of the files knows of."""
        steps = [entry.get("step", 0) for entry in self.log_history] + [event["step"] for event in self.events]
        steps.append(self.record.step if self.record is not None else 0)
        return max(steps)


def read_run(output_dir: str) -> RunFiles:
    """Read the run in `output_dir`. Raises `FileNotFoundError` when it is not a directory, and `ValueError` when
    it holds none of the files a run writes."""
    if not os.path.isdir(output_dir):
        raise FileNotFoundError(f"`{output_dir}` is not a directory: pass the `output_dir` of a training run.")
    record = read_progress(output_dir)
    source = newest_trainer_state(output_dir, record)
    history = _log_history(source) if source is not None else []
    events = read_events(output_dir) + cut_process_events(output_dir, record)
    run = RunFiles(output_dir, history, source if history else None, events, record)
    if source is None and not run.events and run.record is None:
        raise ValueError(
            f"`{output_dir}` holds no `{TRAINER_STATE}`, no checkpoint, no `nan_events.jsonl` and no step record: it "
            "is not the `output_dir` of a run (yet). Pass the directory given as `output_dir` to the trainer."
        )
    return run


def newest_trainer_state(output_dir: str, record: Progress | None = None) -> str | None:
    """The `trainer_state.json` of the furthest step of the run in `output_dir`: its own (written by `save_state`) or
    its newest checkpoint's. With a step `record`, only the checkpoints it lists as this run's (published by it, or
    the one it began from); without, every `checkpoint-N`."""
    candidates = [os.path.join(output_dir, TRAINER_STATE)]
    if record is not None:
        ours = [os.path.join(output_dir, f"checkpoint-{step}") for step in record.history.checkpoints]
        ours += [record.history.origin] if record.history.origin else []
    else:
        ours = [os.path.join(output_dir, name) for name in os.listdir(output_dir) if _CHECKPOINT.match(name)]
    candidates += [os.path.join(path, TRAINER_STATE) for path in ours]
    found = [(_global_step(path), path) for path in candidates if os.path.isfile(path)]
    found = [(step, path) for step, path in found if step is not None]
    return max(found)[1] if found else None


def cut_process_events(output_dir: str, record: Progress | None) -> list[dict[str, Any]]:
    """The events about a process of this run ([`PROCESS_KINDS`]) that a resume cut from the event log (they were
    past the step it resumed at): found in the kept logs, from this run's start on (the step record's times)."""
    starts = [span.began for span in record.history.spans] if record is not None else []
    if record is not None and record.history.began is not None:
        starts.append(record.history.began)
    if not starts:
        return []
    began, found = min(starts), {}
    for path in sorted(glob.glob(os.path.join(glob.escape(output_dir), "nan_events.previous-*.jsonl"))):
        for event in read_event_file(path):
            when = event.get("time")
            if event.get("kind") in PROCESS_KINDS and isinstance(when, (int, float)) and when >= began:
                found[(event["kind"], event["step"], when)] = event
    current = {(e.get("kind"), e.get("step"), e.get("time")) for e in read_events(output_dir)}
    return sorted((e for key, e in found.items() if key not in current), key=lambda e: e["time"])


def _global_step(path: str) -> int | None:
    state = _load(path)
    step = state.get("global_step") if state is not None else None
    return step if isinstance(step, int) else None


def _log_history(path: str) -> list[dict[str, Any]]:
    state = _load(path) or {}
    history = state.get("log_history", [])
    if not isinstance(history, list):
        return []
    return [e for e in history if isinstance(e, dict) and isinstance(e.get("step"), int)]


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None  # a checkpoint being rotated away, or a file cut short
    return state if isinstance(state, dict) else None


__all__ = [
    "PROCESS_KINDS", "TRAINER_STATE", "RunFiles", "cut_process_events", "newest_trainer_state", "read_run",
]  # fmt: skip
