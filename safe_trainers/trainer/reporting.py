"""The run's events in the tools users watch (`docs/observability.md`), when `report_to` names them:

* TensorBoard: each event as a marker at its own step, in the event files of transformers' `TensorBoardCallback`
  (its `tb_writer`, so in the directory the user opens): a scalar `nan_guard/events/<kind>` of 1 and a text
  `nan_guard/events` saying what happened;
* W&B: one `run.alert` per event kind per `event_alert_interval` seconds ([`AlertLimiter`]; the events held back
  are counted into the next alert of their kind), and the guard's counters with the events per kind in the run's
  summary. Nothing is logged to W&B's history here: the counters ride in the Trainer's own `log` (`hooks.py`), in the
  commit of its loss, and no `wandb.log` with a step of ours can fall on a step W&B already committed.

Every event reaches the [`EventReporter`] as it is added to the event log, whichever module adds it (an observer of
[`EventLog`]), on the main process only; the events added before the integrations opened their writers (a `resume`
at train start) wait until [`EventReportCallback`] finds the writers, at the first step. Events added after
TensorBoard's callback closed its writer (`restore`, `preempt` after the last step) go to the same writer, reopened
on the same directory and closed again.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback, WandbCallback

from ..runtime.alerts import ALERT_LEVELS, AlertLimiter
from ..runtime.events import RunEvent
from ..timeline.markers import MARKER_KINDS, describe, marker_kind

logger = logging.getLogger("safe_trainers")

REPORTED = ("tensorboard", "wandb")  # the `report_to` names whose integrations the events reach
EVENT_SCALAR = "nan_guard/events/{kind}"
EVENT_TEXT = "nan_guard/events"
EVENT_COUNT = "nan_guard/events/{kind}"  # in W&B's run summary: the events of each kind this process saw
# W&B reads a `wait_duration` of 0 (falsy) as its default, one minute, and counts it in milliseconds: an
# `event_alert_interval=0` is passed as 1 ms, so that W&B's own limit on alerts of one title lets every alert through.
LEAST_WAIT = 0.001
# The limiter here enforces `event_alert_interval`; W&B's server-side limit is given half of it, so that an alert sent
# exactly one interval after the last one is never dropped there for arriving a little early.
SERVER_WAIT_SHARE = 0.5
# How long an event waits for another thread's report in progress (a `hang` from the watchdog's thread must never block
# on a main thread stuck in a writer's flush: past this, it is left to the event log alone).
LOCK_WAIT = 5.0


def reports_events(report_to: Any) -> bool:
    """Whether `report_to` (the Trainer's resolved list, or one name) names an integration the events reach."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return any(name in REPORTED or name == "all" for name in names)


def event_line(event: RunEvent) -> str:
    """One line on an event: the timeline's description (`timeline/markers.py`), or its kind for a kind without a
    marker."""
    data = event.to_dict()
    kind = marker_kind(data)
    return f"step {event.step}: " + (describe(kind, data) if kind is not None else event.kind)


def event_text(event: RunEvent) -> str:
    """What the TensorBoard text and the W&B alert say: the line, then the event as recorded (Markdown)."""
    data = {k: v for k, v in event.to_dict().items() if k != "time"}
    return event_line(event) + "\n\n" + "\n".join("    " + line for line in json.dumps(data, indent=1).splitlines())


class TensorBoardSink:
    """Writes events as markers with the `TensorBoardCallback`'s writer (`writer`: the one it opened)."""

    def __init__(self, callback: TensorBoardCallback):
        self.callback = callback
        self.writer: Any = None

    def bind(self) -> bool:
        if self.callback.tb_writer is not None:
            self.writer = self.callback.tb_writer
        return self.writer is not None

    def send(self, event: RunEvent, counters: dict[str, Any]) -> None:
        self.writer.add_scalar(EVENT_SCALAR.format(kind=event.kind), 1.0, event.step)
        self.writer.add_text(EVENT_TEXT, event_text(event), event.step)
        self.writer.flush()
        if self.callback.tb_writer is not self.writer:  # the integration closed it (train end): closed again
            self.writer.close()

    def summarize(self, counters: dict[str, Any]) -> None:
        pass  # the counters are in its scalars already (the Trainer's logs)


class WandbSink:
    """Raises W&B alerts (rate-limited per kind) and keeps the counters in the run's summary (`wandb.run`)."""

    def __init__(self, interval: float, clock: Callable[[], float] | None = None):
        self.limiter = AlertLimiter(interval) if clock is None else AlertLimiter(interval, clock)
        self.run: Any = None

    def bind(self) -> bool:
        import wandb  # installed and imported already: its callback is in the handler

        self.run = wandb.run
        return self.run is not None

    def send(self, event: RunEvent, counters: dict[str, Any]) -> None:
        level = ALERT_LEVELS.get(event.kind)
        held = self.limiter.take(event.kind) if level is not None else None
        if held is not None:
            label = MARKER_KINDS[marker_kind(event.to_dict()) or event.kind].label
            more = f"\n\n({held} more `{event.kind}` events since the last alert of this kind.)" if held else ""
            self.run.alert(
                title=f"safe_trainers: {label}"[:63], text=event_text(event) + more, level=level,
                wait_duration=max(self.limiter.interval * SERVER_WAIT_SHARE, LEAST_WAIT),
            )  # fmt: skip
        self.summarize(counters)

    def summarize(self, counters: dict[str, Any]) -> None:
        self.run.summary.update(counters)


class EventReporter:
    """Hands the run's events to the reporting integrations of the trainer (main process only).

    Args:
        main (`bool`): this is the main process (the only one that reports).
        counters (`Callable[[], dict]`): the guard's counters now (`GuardState.counters`).
        interval (`float`): `event_alert_interval`, the least seconds between two W&B alerts of one kind.
    """

    def __init__(self, main: bool, counters: Callable[[], dict[str, Any]], interval: float):
        self.main, self.counters, self.interval = main, counters, interval
        self.pending: list[RunEvent] = []
        self.sinks: list[Any] | None = None  # found at the first `bind` after the integrations' train begin
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()  # a `hang` is added on the watchdog's thread

    def __call__(self, event: RunEvent) -> None:
        """An event was added to the log ([`EventLog`] observer)."""
        if not self.main:
            return
        if not self.lock.acquire(timeout=LOCK_WAIT):
            logger.warning(f"The `{event.kind}` event at step {event.step} was not reported to TensorBoard or W&B: "
                           "another report is stuck; it is in `nan_events.jsonl`.")  # fmt: skip
            return
        try:
            self.seen[event.kind] += 1
            self.pending.append(event)
            self._drain()
        finally:
            self.lock.release()

    def bind(self, callbacks: list[Any]) -> None:
        """Find the writers the integrations among `callbacks` opened, and send what waited for them."""
        if not self.main:
            return
        with self.lock:
            if self.sinks is None:  # once: a sink keeps its rate limits across `train()` calls
                self.sinks = [TensorBoardSink(cb) for cb in callbacks if isinstance(cb, TensorBoardCallback)]
                if any(isinstance(cb, WandbCallback) for cb in callbacks):
                    self.sinks.append(WandbSink(self.interval))
            self._drain()

    def summarize(self) -> None:
        """Put the counters into the summaries (train end: events after the last log)."""
        with self.lock:
            for sink in self._ready():
                sink.summarize(self._summary())

    def _ready(self) -> list[Any]:
        return [sink for sink in self.sinks or [] if sink.bind()]

    def _summary(self) -> dict[str, Any]:
        counts = {EVENT_COUNT.format(kind=kind): n for kind, n in sorted(self.seen.items())}
        return {**self.counters(), **counts}

    def _drain(self) -> None:
        if self.sinks is None:
            return  # not bound yet: the integrations open their writers at train begin, after the run's callbacks
        ready = self._ready()
        if not ready:
            if not self.sinks:
                self.pending.clear()  # no integration the events reach
            return
        events, self.pending = self.pending, []
        for event in events:
            for sink in ready:
                try:
                    sink.send(event, self._summary())
                except Exception as error:  # a reporting tool that fails never stops training
                    logger.warning(f"NaN guard: the `{event.kind}` event of step {event.step} was not sent to "
                                   f"{type(sink).__name__}: {error!r}")


class EventReportCallback(TrainerCallback):
    """Binds the [`EventReporter`] to the integrations' writers once they opened them (first step, logs, train end),
    and puts the final counters into W&B's summary at train end."""

    priority = 5  # see `run.py`: after the guard's and the watchdog's, whose events it reports at train end
    leaves_state_alone = True  # see `read_only.py`

    def __init__(self, trainer: Any, reporter: EventReporter):
        self.trainer, self.reporter = trainer, reporter

    def on_step_begin(self, args, state, control, **kwargs: Any):
        if self.reporter.sinks is None:
            self.reporter.bind(self.trainer.callback_handler.callbacks)

    def on_log(self, args, state, control, **kwargs: Any):
        self.reporter.bind(self.trainer.callback_handler.callbacks)

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.reporter.bind(self.trainer.callback_handler.callbacks)
        self.reporter.summarize()


__all__ = ["EventReportCallback", "EventReporter", "event_line", "event_text", "reports_events"]
