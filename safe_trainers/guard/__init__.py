"""The in-loop NaN guard: skip non-finite updates, roll back to the last good state, diagnose.

What other packages import from the guard is this module's; the rest is the guard's own. The guard holds no trainer:
[`NanGuard`] reads the loop through a [`GuardPort`] and returns its decisions ([`Decision`]) for the integration layer
(`safe_trainers/trainer/`) to carry out.
"""

from ..runtime.events import EVENTS_FILE, RunEvent, read_events
from .nan_guard import NanGuard
from .port import Decision, EndRestore, GuardPort, Judged
from .state import GUARD_STATE_FILE, GuardState

NanEvent = RunEvent  # the event's name before it carried the run's resumes, preemptions and hangs too

__all__ = [
    "EVENTS_FILE", "GUARD_STATE_FILE", "Decision", "EndRestore", "GuardPort", "GuardState", "Judged", "NanEvent",
    "NanGuard", "RunEvent", "read_events",
]  # fmt: skip
