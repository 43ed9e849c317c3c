"""The format of `nan_guard_state.json`, the guard's state saved with every checkpoint: its name, its size limit and
the check of its fields. Read by the guard when a run resumes ([`GuardState.load`]) and by the completeness check of
a checkpoint before a resume picks it (`restarts/completeness.py`)."""

from __future__ import annotations

import sys
from typing import Any

GUARD_STATE_FILE = "nan_guard_state.json"
# The largest guard state read (a few hundred bytes, with a spike window of a few thousand floats).
GUARD_STATE_LIMIT = 16 * 2**20

_NUMBER = (int, float)
# What `GuardState.load` restores: field -> the types it accepts.
GUARD_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "skipped_steps": (int,),
    "overflow_steps": (int,),
    "rollbacks": (int,),
    "discarded_steps": (int,),
    "discarded_through": (int,),
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


__all__ = ["GUARD_STATE_FILE", "GUARD_STATE_LIMIT", "GUARD_STATE_TYPES", "guard_state_problem"]
