"""A job's end time, met without a signal: publish a verified checkpoint and exit resumable before the scheduler ends
the job.

A scheduler that knows when a job ends says so (SLURM exports `SLURM_JOB_END_TIME`, a Unix time; `job_end_time` gives
it for any other). A signal-only save is fragile: when the grace period after SIGTERM is shorter than a save, the save
never lands. So at the end of each optimizer step the run asks whether it could still train one more step and then
save before the end ([`deadline_reached`]):

    now + (1 + stop_lag) x longest step + save time + `job_end_slack` >= end

where `stop_lag` is the steps between a request and the step every rank stops at (0 in one process; 2 under several
ranks, whose requests ride on the guard's per-step all-reduce and are read back a step later: `preemption.py`), the
longest step is the longest seen this run, and the save time is the longest measured save (from the end of a step to
its checkpoint's publication, the guard's check and any evaluation of that step included), or, before the first, the
state's bytes at [`ASSUMED_WRITE_RATE`]. When it holds, the run stops as for a preemption signal: every rank finishes
the same step, the guard verifies and publishes it, and `train()` raises `Preempted` (exit status 75); a relaunch with
`resume_from_checkpoint=True` (or a restart) goes on from it. A job without an end time behaves as before.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

logger = logging.getLogger("safe_trainers")

SLURM_END = "SLURM_JOB_END_TIME"  # set by SLURM for every job with a time limit: the end as a Unix time
ASSUMED_WRITE_RATE = 100e6  # bytes per second a save is assumed to write at before one is measured (slow storage)


def job_end_time(setting: float | None, environ: Mapping[str, str]) -> tuple[float, str] | None:
    """When the job ends, and who said so: `job_end_time` when set (`0` or less: no deadline, whatever the scheduler
    says), else `SLURM_JOB_END_TIME` from the scheduler's environment, else `None` (no deadline).

    Raises:
        `ValueError`: `SLURM_JOB_END_TIME` is not a Unix time.
    """
    if setting is not None:
        return (float(setting), "`job_end_time`") if setting > 0 else None
    raw = environ.get(SLURM_END, "").strip()
    if not raw:
        return None
    try:
        end = float(raw)
    except ValueError:
        raise ValueError(
            f"`{SLURM_END}` is {raw!r}, not a Unix time in seconds. Set `job_end_time` to the job's end as a Unix "
            "time, or `job_end_time=0` to train without a deadline."
        ) from None
    return (end, f"`{SLURM_END}`") if math.isfinite(end) and end > 0 else None


def margin_seconds(longest_step: float, save_seconds: float, slack: float, stop_lag: int) -> float:
    """How long before the end a run must ask to stop: one more step and the steps until every rank stops, the save,
    and the slack."""
    return (1 + stop_lag) * longest_step + save_seconds + slack


def deadline_reached(now: float, end: float, margin: float) -> bool:
    """Whether a run at `now` must stop at this step to publish its checkpoint before `end`."""
    return now + margin >= end


def clock_time(moment: float) -> str:
    return datetime.fromtimestamp(moment, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class Deadline:
    """The job's end and the run's measured step and save times (see the module docstring).

    Args:
        end (`float`): the job's end, a Unix time.
        source (`str`): who said so (for the report).
        slack (`float`): `job_end_slack`, seconds.
        state_bytes (`Callable[[], int]`): the bytes a checkpoint writes at least (weights and optimizer state), for
            the save time before one is measured.
        clock (`Callable[[], float]`): the wall clock (Unix time).
    """

    def __init__(
        self, end: float, source: str, slack: float, state_bytes: Callable[[], int],
        clock: Callable[[], float] = time.time,
    ):  # fmt: skip
        self.end, self.source, self.slack = end, source, slack
        self.state_bytes, self.clock = state_bytes, clock
        self.stop_lag = 0
        self.longest_step = 0.0
        self.save_seconds: float | None = None  # the longest save measured, `None` before the first
        self._step_began: float | None = None
        self._saves_began: dict[int, float] = {}  # the saves begun and not yet published, by step

    def save_estimate(self) -> float:
        return self.save_seconds if self.save_seconds is not None else self.state_bytes() / ASSUMED_WRITE_RATE

    def margin(self) -> float:
        """The time the stop needs: its steps, its save, and what is left of a save still being written in the
        background (the stopping step's save waits for it)."""
        estimate, now = self.save_estimate(), self.clock()
        in_flight = sum(max(0.0, estimate - (now - began)) for began in list(self._saves_began.values()))
        return margin_seconds(self.longest_step, estimate, self.slack, self.stop_lag) + in_flight

    def train_began(self, stop_lag: int, say: bool = True) -> str:
        """Training starts (`stop_lag`: see the module docstring): what the run will do, logged when `say` (the main
        process)."""
        self.stop_lag = stop_lag
        self._step_began, self._saves_began = None, {}
        now, margin = self.clock(), self.margin()
        said = (
            f"Job ends at {clock_time(self.end)} ({self.source}): the run publishes a checkpoint and exits with "
            f"status 75 (resumable) by {clock_time(self.end - margin)} at the latest, {margin:.0f} s before, "
            f"re-estimated at every step (the longest step x {1 + stop_lag}, the save time, `job_end_slack`="
            f"{self.slack:g} s). Set `job_end_time=0` to train without a deadline."
        )
        if now >= self.end:
            said += f" The end is already {now - self.end:.0f} s past: the run stops after its first step."
        if say:
            logger.warning(said)
        return said

    def step_began(self) -> None:
        self._step_began = self.clock()

    def step_ended(self) -> bool:
        """A step ended: time it; whether the run must stop at this step."""
        now = self.clock()
        if self._step_began is not None:
            self.longest_step = max(self.longest_step, now - self._step_began)
        self._step_began = None
        return deadline_reached(now, self.end, self.margin())

    def save_began(self, step: int) -> None:
        """Step `step` saves a checkpoint: its time starts at the step's end, or when the save itself begins for a save
        decided later (an epoch's end, a new best metric); the first call for a step stands."""
        self._saves_began.setdefault(step, self.clock())

    def report(self) -> dict[str, float]:
        """The figures of a stop for the deadline, for its `preempt` event."""
        left, margin = round(self.end - self.clock(), 3), round(self.margin(), 3)
        return {"job_end": self.end, "seconds_left": left, "margin": margin}

    def saved(self, step: int) -> None:
        """The checkpoint of `step` begun at [`save_began`] is published (told by `_after_published`, or by a background
        save's writer thread as it publishes; a later save may have begun meanwhile): time it."""
        began = self._saves_began.pop(step, None)
        if began is not None:
            self.save_seconds = max(self.save_seconds or 0.0, self.clock() - began)


__all__ = [
    "ASSUMED_WRITE_RATE", "SLURM_END", "Deadline", "clock_time", "deadline_reached", "job_end_time", "margin_seconds",
]  # fmt: skip
