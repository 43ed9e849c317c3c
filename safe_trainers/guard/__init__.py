"""The in-loop NaN guard: skip non-finite updates, roll back to the last good state, diagnose.

What other packages import from the guard is this module's names; its modules are the guard's own. The guard holds no
trainer: [`NanGuard`] reads the loop through a [`GuardPort`] and returns its decisions ([`Decision`]) for the
integration layer (`safe_trainers/trainer/`) to carry out.

Rooms: `nan_guard` (the doors), `policy` (the verdict and when to inspect, pure), `port` (what the guard reads and
returns), `state` (what it saves with a checkpoint), `records` (the events and messages of what it did), `backends`
(what it binds to), `diagnosis` (the recent batches and the replay's hooks); `step/` the per-step device path (flags,
skip, spikes, the logged loss); `rollback/` the last good state (its sources in memory and on disk, frozen parameters,
the actions on a verdict).
"""

from ..runtime.events import EVENTS_FILE, RunEvent, read_events
from .backends import Backend, backend_problem, unwrap_optimizer
from .diagnosis import localize
from .nan_guard import NanGuard
from .policy import StepReading, Verdict, state_check_step
from .port import Decision, EndRestore, GuardPort, Judged
from .records import discarded_updates, record_rewards, refuse_save
from .rollback.actions import Restored
from .rollback.source import kept_hyperparameters, rollback_source
from .state import GUARD_STATE_FILE, GuardState

NanEvent = RunEvent  # the event's name before it carried the run's resumes, preemptions and hangs too

__all__ = [
    "EVENTS_FILE", "GUARD_STATE_FILE", "Backend", "Decision", "EndRestore", "GuardPort", "GuardState", "Judged",
    "NanEvent", "NanGuard", "Restored", "RunEvent", "StepReading", "Verdict", "backend_problem", "discarded_updates",
    "kept_hyperparameters", "localize", "read_events", "record_rewards", "refuse_save", "rollback_source",
    "state_check_step", "unwrap_optimizer",
]  # fmt: skip
