"""The collapse watch of a run: per step, the new values TRL appended to its metrics, each judged against the run's
own recent window ([`judge`]); a signal past its threshold for `patience` steps in a row starts an episode, reported
once (a `collapse` event and one warning); the episode ends when the signal is back within its threshold for
`patience` steps. Warn-only: nothing here changes training.

No host sync is added: TRL has already brought every value to the host (`.item()`, gathered across processes) when it
appends it to `trainer._metrics["train"]`; the watch reads those Python floats at the end of each step, before
TRL's `log` averages and clears them, so the judgment is per step whatever `logging_steps` is. A metric TRL appends
once per generation (rewards, lengths) is judged at the steps that generated; one it appends per micro-batch
(entropy, KL) at every step, as the mean of the step's micro-batches.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback

from .signals import Signal, Verdict, judge, needed_streak, past, signal

logger = logging.getLogger("safe_trainers")


class StepMetrics:
    """The values appended to TRL's metric lists since the last look. TRL clears its metrics dictionary at each log
    (new lists are made on the next append), so a list held since the last look is read from where the look left
    it; a list that is a new object is read whole only when a log came in between ([`logged`]): otherwise it is a
    copy of the one held (the guard's diagnosis replay puts back a deep copy of `_metrics`), whose values up to
    the last look were judged already."""

    def __init__(self):
        self._seen: dict[str, tuple[list, int, int]] = {}  # key: (list, values read, logs seen then)
        self._logs = 0

    def logged(self) -> None:
        """The Trainer logged (TRL clears its metrics right after): lists made from now on are new ones."""
        self._logs += 1

    def take(self, metrics: Mapping[str, Any], keys: Sequence[str]) -> dict[str, float]:
        """For each of `keys` with new values in `metrics`, their mean (plain floats only: a tensor is never read)."""
        out = {}
        for key in keys:
            values = metrics.get(key)
            if not isinstance(values, list):
                continue
            held, count, logs = self._seen.get(key, (None, 0, self._logs))
            start = count if held is values or (held is not None and logs == self._logs) else 0
            self._seen[key] = (values, len(values), self._logs)
            new = [v for v in values[start:] if isinstance(v, (int, float)) and math.isfinite(v)]
            if new:
                out[key] = sum(new) / len(new)
        return out


@dataclass
class SignalState:
    """One signal's window of in-band values, its recent values, and its episode bookkeeping."""

    rule: Signal
    window: deque = field(default_factory=deque)
    recent: deque = field(default_factory=deque)  # every recent value but a streak's in progress and an episode's
    crossed: list = field(default_factory=list)  # the streak in progress: consecutive values past the threshold
    back: int = 0  # consecutive values within it, during an episode
    in_episode: bool = False
    streak: int = 0  # the values in a row that started the current episode

    def observe(self, value: float, warmup: int, patience: int) -> Verdict | None:
        """Judge `value`; returns the verdict when it starts an episode, else `None`. A value past the threshold
        does not enter the window, so a collapse never becomes the level it is judged against; the streak it starts
        must be as long as [`needed_streak`] asks given how many `recent` values lie past the same threshold (the
        values of a streak too short to be a collapse join them once it ends; an episode's values, in band or not, never
        do: its crossed ones are the collapse, and its in-band ones alone would make the run look as if it rarely
        crossed)."""
        if len(self.window) < warmup:
            self.window.append(value)
            self.recent.append(value)
            return None
        verdict = judge(self.window, value, self.rule)
        if verdict.crossed:
            self.crossed.append(value)
            self.back = 0
            if not self.in_episode:
                by_chance = sum(past(v, verdict.threshold, self.rule.direction) for v in self.recent)
                if len(self.crossed) >= needed_streak(by_chance, len(self.recent), patience):
                    self.in_episode, self.streak = True, len(self.crossed)
                    return verdict
            return None
        if not self.in_episode:
            self.recent.extend(self.crossed)
            self.recent.append(value)
        self.crossed = []
        self.window.append(value)
        if self.in_episode:
            self.back += 1
            self.in_episode = self.back < patience
        return None


class CollapseWatch:
    """Judges the signals named in `signals` at each step.

    Args:
        signals (`Sequence[str]`): names of [`SIGNALS`] rows to watch.
        window (`int`): how many recent in-band values each signal's level and scale cover.
        patience (`int`): values past the threshold in a row that make an episode (and within it, that end one).
        report (`Callable`, *optional*): called with `(step, signal, verdict, window_size, streak)` when an episode
            starts (`streak`: the values in a row past the threshold that made it).
    """

    def __init__(
        self,
        signals: Sequence[str],
        window: int,
        patience: int,
        report: Callable[[int, Signal, Verdict, int, int], None] | None = None,
    ):
        self.states = [
            SignalState(signal(name), deque(maxlen=window), deque(maxlen=window)) for name in dict.fromkeys(signals)
        ]
        self.warmup = max(2, window // 2)
        self.patience = patience
        self.report = report
        self.metrics = StepMetrics()
        self.episodes: list[tuple[int, str]] = []  # (step, signal) of each episode started

    def step_end(self, step: int, metrics: Mapping[str, Any]) -> list[tuple[str, Verdict]]:
        """Judge the values TRL appended during `step`; returns the episodes started (and reports each)."""
        values = self.metrics.take(metrics, [state.rule.key for state in self.states])
        started = []
        for state in self.states:
            if state.rule.key not in values:
                continue
            verdict = state.observe(values[state.rule.key], self.warmup, self.patience)
            if verdict is not None:
                started.append((state.rule.name, verdict))
                self.episodes.append((step, state.rule.name))
                if self.report is not None:
                    self.report(step, state.rule, verdict, len(state.window), state.streak)
        return started


def collapse_detail(rule: Signal, verdict: Verdict, window: int, patience: int, streak: int) -> dict[str, Any]:
    """The `detail` of a `collapse` event (`streak`: the values in a row past the threshold, `patience` or more)."""
    def short(x: float) -> float:
        return float(f"{x:.6g}")

    return {
        "signal": rule.name, "metric": rule.key, "value": short(verdict.value), "median": short(verdict.median),
        "scale": short(verdict.scale), "threshold": short(verdict.threshold), "direction": rule.direction,
        "window": window, "patience": patience, "streak": streak,
    }  # fmt: skip


def collapse_message(step: int, rule: Signal, verdict: Verdict, window: int, streak: int) -> str:
    """The warning of an episode's start."""
    side = "below" if rule.direction == "down" else "above"
    return (
        f"Collapse watch: `{rule.key}` = {verdict.value:.4g} at step {step}, {side} its threshold "
        f"{verdict.threshold:.4g} for {streak} step(s) in a row (median of the last {window}: {verdict.median:.4g}, "
        f"scale {verdict.scale:.3g}): {rule.meaning}. Training goes on (warn-only); check the learning rate and the "
        f"reward functions, or set `collapse_signals` to leave `{rule.name}` out."
    )


class CollapseCallback(TrainerCallback):
    """Runs the trainer's [`CollapseWatch`] at the end of each step (on every rank alike; the main process writes the
    events), before the Trainer's log clears TRL's metrics.

    Args:
        trainer: the GRPO or RLOO trainer (its `_metrics`).
        watch ([`CollapseWatch`]): the watch.
    """

    priority = 0  # see `trainer/run.py`: reads only host floats, anywhere among the run's callbacks
    leaves_state_alone = True  # see `trainer/read_only.py`

    def __init__(self, trainer: Any, watch: CollapseWatch):
        self.trainer = trainer
        self.watch = watch

    def on_step_end(self, args, state, control, **kwargs: Any):
        metrics = getattr(self.trainer, "_metrics", {}).get("train", {})
        self.watch.step_end(state.global_step, metrics)

    def on_log(self, args, state, control, **kwargs: Any):
        self.watch.metrics.logged()  # TRL's `log` clears its metrics after the callbacks' `on_log`


__all__ = ["CollapseCallback", "CollapseWatch", "SignalState", "StepMetrics", "collapse_detail", "collapse_message"]
