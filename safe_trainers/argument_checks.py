"""What a valid set of safety fields is: the checks `SafetyArguments` and the safe configs run on construction, and
the values some of the fields take."""

from __future__ import annotations

import math
import warnings
from typing import Any

from .collapse.signals import SIGNAL_NAMES

SAFETY_MODES: tuple[str, ...] = ("fix", "warn", "strict", "off")
HANG_ACTIONS: tuple[str, ...] = ("auto", "exit", "report")  # see `safe_trainers/restarts/hang_report.py`
ROLLBACK_SOURCES: tuple[str, ...] = ("memory", "checkpoint")


def validate_safety_arguments(settings: Any) -> None:
    """Raise a `ValueError` naming the field, the value received and the fix for any invalid safety field, and split
    a string `safety_disable_rules` or `preempt_signals` into its list. What needs the rules or the signal table (an
    unknown rule id, an unknown signal) is checked by the safe configs (`configs.py`) and where it is used."""
    if settings.safety_mode not in SAFETY_MODES:
        raise ValueError(
            f"`safety_mode` must be one of {list(SAFETY_MODES)}, got {settings.safety_mode!r}. Use `\"fix\"` (the "
            "default) to apply and report fixes, or `\"off\"` to disable every rule."
        )
    if isinstance(settings.safety_disable_rules, str):
        settings.safety_disable_rules = [r for r in settings.safety_disable_rules.replace(",", " ").split() if r]
    if settings.nan_rollback_from not in ROLLBACK_SOURCES:
        raise ValueError(
            f"`nan_rollback_from` must be one of {list(ROLLBACK_SOURCES)}, got {settings.nan_rollback_from!r}. Use "
            "`\"memory\"` (the default) to roll back to a host copy, or `\"checkpoint\"` to roll back to the newest "
            "verified checkpoint when host memory cannot hold a copy of the weights and optimizer state."
        )
    if isinstance(settings.collapse_signals, str):
        settings.collapse_signals = [s for s in settings.collapse_signals.replace(",", " ").split() if s]
    settings.collapse_signals = list(dict.fromkeys(settings.collapse_signals))  # a signal named twice: watched once
    unknown = [name for name in settings.collapse_signals if name not in SIGNAL_NAMES]
    if unknown:
        raise ValueError(
            f"`collapse_signals` names unknown signal(s) {unknown}; choose from {list(SIGNAL_NAMES)}, or `[]` to "
            "disable the collapse watch."
        )
    if isinstance(settings.preempt_signals, str):
        settings.preempt_signals = [s for s in settings.preempt_signals.replace(",", " ").split() if s]
    half = settings.collapse_window // 2 if isinstance(settings.collapse_window, int) else 0
    checks = [
        ("hang_action", settings.hang_action in HANG_ACTIONS, f"one of {list(HANG_ACTIONS)}"),
        ("hang_timeout", math.isfinite(settings.hang_timeout) and settings.hang_timeout >= 0, "a number >= 0 (0 off)"),
        ("hang_timeout_factor", settings.hang_timeout_factor > 1, "a number > 1"),
        ("nan_snapshot_steps", settings.nan_snapshot_steps is None or settings.nan_snapshot_steps >= 1,
         "an integer >= 1"),
        ("nan_snapshot_budget", math.isfinite(settings.nan_snapshot_budget) and 0 <= settings.nan_snapshot_budget < 1,
         "a fraction in [0, 1) (0: a fixed interval of `nan_snapshot_steps`)"),
        ("nan_max_rollbacks", settings.nan_max_rollbacks >= 0, "an integer >= 0"),
        ("nan_max_consecutive_skips", settings.nan_max_consecutive_skips >= 1, "an integer >= 1"),
        ("nan_lr_backoff", math.isfinite(settings.nan_lr_backoff) and 0 < settings.nan_lr_backoff <= 1, "in (0, 1]"),
        ("nan_spike_factor", settings.nan_spike_factor == 0 or settings.nan_spike_factor > 1, "0 (off) or > 1"),
        ("nan_spike_window", settings.nan_spike_window >= 2, "an integer >= 2"),
        ("nan_replay_max_bytes", settings.nan_replay_max_bytes >= 0, "an integer >= 0 (0: no replay bundles)"),
        ("nan_replay_limit", settings.nan_replay_limit >= 1,
         "an integer >= 1 (`nan_replay_max_bytes=0` turns bundles off)"),
        (
            "nan_spike_warmup",
            2 <= settings.nan_spike_warmup <= settings.nan_spike_window,
            f"an integer from 2 to `nan_spike_window` ({settings.nan_spike_window})",
        ),
        ("collapse_window", isinstance(settings.collapse_window, int) and settings.collapse_window >= 4,
         "an integer >= 4"),
        ("collapse_patience", isinstance(settings.collapse_patience, int) and 1 <= settings.collapse_patience <= half,
         f"an integer from 1 to half of `collapse_window` ({half})"),
        ("skip_step_after_crashes", settings.skip_step_after_crashes >= 0, "an integer >= 0 (0 disables)"),
        ("job_end_time", settings.job_end_time is None or math.isfinite(settings.job_end_time),
         "a Unix time in seconds (0: no deadline)"),
        ("job_end_slack", math.isfinite(settings.job_end_slack) and settings.job_end_slack >= 0, "a number >= 0"),
        ("event_alert_interval", math.isfinite(settings.event_alert_interval) and settings.event_alert_interval >= 0,
         "a number of seconds >= 0 (0: one alert per event)"),
        ("save_in_background", isinstance(settings.save_in_background, bool), "`True` or `False`"),
    ]
    for name, ok, expected in checks:
        if not ok:
            raise ValueError(f"`{name}` must be {expected}, got {getattr(settings, name)!r}.")
    if settings.nan_spike_patience is not None:
        warnings.warn(
            f"`nan_spike_patience` is deprecated and has no effect (got {settings.nan_spike_patience!r}): a spiking "
            "step is now skipped before its update, and `nan_max_consecutive_skips` skipped steps in a row roll "
            "back. Remove it from your config.",
            FutureWarning,
            stacklevel=3,
        )


__all__ = ["HANG_ACTIONS", "ROLLBACK_SOURCES", "SAFETY_MODES", "validate_safety_arguments"]
