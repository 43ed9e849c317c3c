"""The in-loop NaN guard: skip non-finite updates, roll back to the last good state, diagnose."""

from .callback import NanGuardCallback
from .events import EVENTS_FILE, NanEvent, read_events
from .guard import NanGuard
from .state import GUARD_STATE_FILE, GuardState

__all__ = ["EVENTS_FILE", "GUARD_STATE_FILE", "GuardState", "NanEvent", "NanGuard", "NanGuardCallback", "read_events"]
