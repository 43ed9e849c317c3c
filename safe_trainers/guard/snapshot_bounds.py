"""The bounds of the guard's snapshot interval as the run sets them, and how the safety report says them before
training starts (`snapshot_interval.py` adapts the interval within them): at least `nan_snapshot_steps` (else 1), at
most the checkpoint interval (`save_steps`, when checkpoints are saved every so many steps)."""

from __future__ import annotations

import math
from typing import Any

DEFAULT_STEPS = 10  # the interval to start with, and the flag-read cadence, when `nan_snapshot_steps` is not set


def saves_every_steps(config: Any) -> bool:
    """`save_strategy="steps"` (a string, or transformers' `SaveStrategy` enum)."""
    strategy = getattr(config, "save_strategy", None)
    return str(getattr(strategy, "value", strategy)) == "steps"


def run_fraction(config: Any) -> float | None:
    """`save_steps` when it is a fraction of the run (below 1: the Trainer makes it steps when training starts)."""
    steps = getattr(config, "save_steps", None)
    return float(steps) if saves_every_steps(config) and steps and 0 < steps < 1 else None


def checkpoint_interval(config: Any, state: Any) -> int | None:
    """The steps between checkpoints when they are saved every so many steps, else `None`: `save_steps` as the Trainer
    resolved it into `state.save_steps`, or before training (`state` is `None`) from `config` (a fraction of the run
    taken of `max_steps` as the Trainer will, when `max_steps` is set; else not known yet)."""
    if not saves_every_steps(config):
        return None
    steps = getattr(state, "save_steps", None) or getattr(config, "save_steps", None)
    fraction, max_steps = run_fraction(config), getattr(config, "max_steps", -1) or -1
    if state is None and fraction is not None and max_steps > 0:
        steps = math.ceil(fraction * max_steps)
    return int(steps) if steps and steps >= 1 else None


def percent(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def describe(settings: Any, config: Any) -> str:
    """What the snapshots do, in a few words for the safety report's summary (before training: the bounds as set)."""
    steps, budget = settings.nan_snapshot_steps, settings.nan_snapshot_budget
    if budget <= 0:
        return f"snapshot every {steps or DEFAULT_STEPS} steps"
    lower, upper, fraction = steps or 1, checkpoint_interval(config, None), run_fraction(config)
    if upper and upper <= lower:  # the user's lower bound wins (`choose_interval`): nothing left to adapt
        return f"snapshot every {lower} steps (`nan_snapshot_steps` >= `save_steps`)"
    if upper:
        bound = f"every {lower}-{upper} steps"
    elif fraction is not None:  # the run's length is not known before training
        bound = f"every {lower} steps to `save_steps` ({fraction:g} of the run)"
    else:
        bound = f"every >= {lower} steps"
    return f"snapshots adapt to <= {percent(budget)} of wall time, {bound}"


__all__ = ["DEFAULT_STEPS", "checkpoint_interval", "describe", "percent", "run_fraction", "saves_every_steps"]
