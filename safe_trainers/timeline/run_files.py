"""What a run wrote that its timeline reads: the Trainer's log history (`trainer_state.json`, the newest one: the run's
own, or its newest checkpoint's while it runs or after it died), the event log (`nan_events.jsonl`) and the step
record (`.safe_trainers_progress.json`). Each may be missing: a run that has not saved yet has no log history, a run
without the guard no event log; the timeline shows what there is."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..restarts.progress import Progress, read_progress
from ..runtime.events import read_events

TRAINER_STATE = "trainer_state.json"
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
    source = newest_trainer_state(output_dir)
    history = _log_history(source) if source is not None else []
    run = RunFiles(output_dir, history, source if history else None, read_events(output_dir), read_progress(output_dir))
    if source is None and not run.events and run.record is None:
        raise ValueError(
            f"`{output_dir}` holds no `{TRAINER_STATE}`, no checkpoint, no `nan_events.jsonl` and no step record: it "
            "is not the `output_dir` of a run (yet). Pass the directory given as `output_dir` to the trainer."
        )
    return run


def newest_trainer_state(output_dir: str) -> str | None:
    """The `trainer_state.json` of the furthest step in `output_dir`: its own (written by `save_state`) or its newest
    published checkpoint's."""
    candidates = [os.path.join(output_dir, TRAINER_STATE)]
    for name in os.listdir(output_dir):
        if _CHECKPOINT.match(name):
            candidates.append(os.path.join(output_dir, name, TRAINER_STATE))
    found = [(_global_step(path), path) for path in candidates if os.path.isfile(path)]
    found = [(step, path) for step, path in found if step is not None]
    return max(found)[1] if found else None


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


__all__ = ["TRAINER_STATE", "RunFiles", "newest_trainer_state", "read_run"]
