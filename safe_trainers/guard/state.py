"""The guard's own state that outlives a process: counters, LR backoff and the spike detector's window, saved with
every checkpoint."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields

from ..runtime.files import write_text_no_follow
from ..runtime.guard_state_file import GUARD_STATE_FILE, GUARD_STATE_LIMIT, guard_state_problem
from .step.spikes import SpikeWindow

logger = logging.getLogger("safe_trainers")


@dataclass
class GuardState:
    """What the guard saves with each checkpoint (`nan_guard_state.json`) and restores on resume."""

    skipped_steps: int = 0
    overflow_steps: int = 0
    rollbacks: int = 0
    discarded_steps: int = 0
    discarded_through: int = 0  # the latest step a rollback threw away (see [`count_discarded`])
    lr_scale: float = 1.0
    learning_rate: float | None = None  # the configured `learning_rate` the backoff applies to
    localized: bool = False
    spike_steps: int = 0
    spike_window: dict[str, list[float]] | None = None  # `SpikeWindow.history()`, as of the checkpoint

    def counters(self) -> dict[str, int]:
        """What goes into every log (W&B, TensorBoard, ...)."""
        return {
            "nan_guard/skipped_steps": self.skipped_steps,
            "nan_guard/rollbacks": self.rollbacks,
            "nan_guard/discarded_steps": self.discarded_steps,
            "nan_guard/overflow_steps": self.overflow_steps,
            "nan_guard/spike_steps": self.spike_steps,
        }

    def count_discarded(self, steps: list[int]) -> None:
        """Count the steps a rollback threw away, each once: `global_step` never rewinds, so a second rollback to the
        same snapshot lists the first one's steps again, and only those past the latest counted are new."""
        self.discarded_steps += sum(1 for step in steps if step > self.discarded_through)
        self.discarded_through = max([self.discarded_through, *steps])

    def save(self, checkpoint_dir: str, spikes: SpikeWindow | None = None) -> None:
        """Write the state into `checkpoint_dir`, with the window of `spikes`, the guard's spike detector (a host
        read of its few values)."""
        self.spike_window = spikes.history() if spikes is not None else None
        write_text_no_follow(os.path.join(checkpoint_dir, GUARD_STATE_FILE), json.dumps(asdict(self)))

    @classmethod
    def load(cls, checkpoint_dir: str) -> "GuardState | None":
        """The state saved in `checkpoint_dir`, or `None` if it has none (a checkpoint of an unguarded run) or it is
        not usable (too large, does not parse, fields of the wrong type: a warning says why, the counters start
        over)."""
        path = os.path.join(checkpoint_dir, GUARD_STATE_FILE)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                saved = json.loads(f.read(GUARD_STATE_LIMIT + 1))
            problem = guard_state_problem(saved)
        except (OSError, ValueError, RecursionError) as error:
            problem = f"does not parse ({type(error).__name__}: {error})"
        if problem is not None:
            logger.warning(f"NaN guard: `{path}` {problem}; it is not used: the guard's counters start at 0.")
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})
