"""Which events become alerts (W&B's `run.alert`), at which level, and how often: at most one alert per event kind per
`event_alert_interval` seconds; the events of that kind held back meanwhile are counted into the next one. Pure: the
clock is passed in (`trainer/reporting.py` sends the alerts)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

# Event kinds (`runtime/events.py`) -> the alert level (W&B's `AlertLevel` names). `snapshot_interval` (a setting the
# guard chose, not an incident) raises none.
ALERT_LEVELS: dict[str, str] = {
    "abort": "ERROR",
    "hang": "ERROR",
    "skip": "WARN",
    "spike": "WARN",
    "rollback": "WARN",
    "reward": "WARN",
    "save_refused": "WARN",
    "restore": "WARN",
    "poison": "WARN",
    "shard_missing": "WARN",
    "collapse": "WARN",
    "overflow": "INFO",
    "preempt": "INFO",
    "resume": "INFO",
}


def alert_due(last_sent: float | None, now: float, interval: float) -> bool:
    """Whether an alert of a kind last sent at `last_sent` (`None`: never) may go out at `now` (seconds, one clock)."""
    return last_sent is None or now - last_sent >= interval


class AlertLimiter:
    """At most one alert per kind per `interval` seconds of `clock`.

    Args:
        interval (`float`): the least time between two alerts of one kind (`0`: every event).
        clock (`Callable[[], float]`): seconds, only differences are used (`time.monotonic` by default).
    """

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self.sent: dict[str, float] = {}
        self.held: Counter[str] = Counter()

    def take(self, kind: str) -> int | None:
        """An event of `kind` happened: `None` if its alert is held back (counted), else how many events of that
        kind were held back since its last alert (the alert goes out now)."""
        now = self.clock()
        if not alert_due(self.sent.get(kind), now, self.interval):
            self.held[kind] += 1
            return None
        self.sent[kind] = now
        return self.held.pop(kind, 0)


__all__ = ["ALERT_LEVELS", "AlertLimiter", "alert_due"]
