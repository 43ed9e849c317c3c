"""The guard's own state that outlives a process: counters, LR backoff and the spike detector's window, saved with
every checkpoint."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..files import write_text_no_follow
from .spikes import SpikeWindow

GUARD_STATE_FILE = "nan_guard_state.json"
# The largest guard state read (a few hundred bytes, with a spike window of a few thousand floats).
GUARD_STATE_LIMIT = 16 * 2**20
logger = logging.getLogger("safe_trainers")


@dataclass
class GuardState:
    """What the guard saves with each checkpoint (`nan_guard_state.json`) and restores on resume."""

    skipped_steps: int = 0
    overflow_steps: int = 0
    rollbacks: int = 0
    discarded_steps: int = 0
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


_NUMBER = (int, float)
# What `GuardState.load` restores: field -> the types it accepts.
GUARD_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "skipped_steps": (int,),
    "overflow_steps": (int,),
    "rollbacks": (int,),
    "discarded_steps": (int,),
    "lr_scale": _NUMBER,
    "learning_rate": (*_NUMBER, type(None)),
    "localized": (bool,),
    "spike_steps": (int,),
    "spike_window": (dict, type(None)),
}


def guard_state_problem(saved: Any) -> str | None:
    """Why a parsed `nan_guard_state.json` cannot be restored (after "`nan_guard_state.json` "), or `None`."""
    if not isinstance(saved, dict):
        return f"is a JSON `{type(saved).__name__}`, not an object"
    for key, types in GUARD_STATE_TYPES.items():
        value = saved.get(key)
        if key in saved and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            return f"holds `{key}` of type `{type(value).__name__}`"
    window = saved.get("spike_window") or {}
    if not all(isinstance(v, list) and all(_float(x) for x in v) for v in window.values()):
        return "holds a `spike_window` that is not lists of numbers"
    return None


def _float(value: Any) -> bool:
    """Whether `value` is a number the window's float tensor can hold (an integer past a float's range is not)."""
    return isinstance(value, float) or (isinstance(value, int) and abs(value) <= sys.float_info.max)
