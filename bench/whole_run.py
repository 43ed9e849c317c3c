"""The guard benches' headline measurement: stock TRL against safe_trainers over whole `train()` calls, in one process,
interleaved (stock, safe, safe, stock, ...: the order alternates each round, so slow drift of the machine falls on
both), and the ratio of the summed whole-run times as the headline, with the per-step median beside it.

Why whole runs: the guard's cost comes in bursts (a check + snapshot every `nan_snapshot_steps`, a check before each
save and at the end), which the median of per-step times drops by construction; the time of the whole `train()` call,
with its logs and saves, is what a user pays. Not a benchmark itself.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field


KINDS = ("stock", "safe")


@dataclass
class Comparison:
    """The runs of one configuration: for each kind, the whole-run times and each run's median step time (seconds),
    one entry per round."""

    whole: dict[str, list[float]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    step: dict[str, list[float]] = field(default_factory=lambda: {kind: [] for kind in KINDS})

    def add(self, kind: str, whole: float, step_times: list[float]) -> None:
        self.whole[kind].append(whole)
        self.step[kind].append(statistics.median(step_times) if step_times else float("nan"))

    @property
    def whole_ratio(self) -> float:
        """The headline: summed whole-run time, safe / stock."""
        return sum(self.whole["safe"]) / sum(self.whole["stock"])

    @property
    def round_ratios(self) -> list[float]:
        """Whole-run time, safe / stock, per round (their spread is the machine's noise)."""
        return [safe / stock for safe, stock in zip(self.whole["safe"], self.whole["stock"])]

    @property
    def step_ratio(self) -> float:
        """The per-step median ratio: the median over rounds of (median safe step / median stock step). Blind to
        the steps that carry a snapshot, a save or the end's checks."""
        return statistics.median(s / t for s, t in zip(self.step["safe"], self.step["stock"]))

    def median_step(self, kind: str) -> float:
        return statistics.median(self.step[kind])

    def mean_run(self, kind: str) -> float:
        return statistics.mean(self.whole[kind])


def interleave(rounds: int, run: Callable[[str, int], tuple[float, list[float]]]) -> Comparison:
    """`rounds` pairs of runs, `run(kind, round_index) -> (whole-run seconds, step times)`, the order alternating."""
    found = Comparison()
    for round_index in range(rounds):
        for kind in KINDS if round_index % 2 == 0 else KINDS[::-1]:
            found.add(kind, *run(kind, round_index))
    return found


@dataclass(frozen=True)
class SnapshotAccount:
    """The guard's own account of one safe run: its snapshots' steps, the wall seconds of its snapshot work (checks,
    copies, buffer allocations: `SnapshotInterval.spent_seconds`) and their share of the run's wall time."""

    steps: list[int]
    seconds: float
    share: float


def snapshot_account(trainer, wall: float) -> SnapshotAccount:
    """[`SnapshotAccount`] of the run `trainer` just trained in `wall` seconds; read it before timing any snapshot of
    your own (each one taken adds to the account)."""
    interval = trainer.nan_guard.interval
    return SnapshotAccount(interval.taken_at, interval.spent_seconds, interval.spent_seconds / wall)


def run_shape(steps: int, logging_steps: int, save_steps: int, snapshot_steps: int | None) -> str:
    """The caption's description of what one run does."""
    saves = f"a checkpoint every {save_steps} steps" if save_steps else "no checkpoint"
    snapshots = f"at least {snapshot_steps} steps apart" if snapshot_steps else "`nan_snapshot_steps` unset"
    return f"{steps} steps, logging every {logging_steps}, {saves}, guard snapshots adaptive ({snapshots})"


def step_clock_note(gpu: bool) -> str:
    """How the per-step times were taken (the caption says it)."""
    if gpu:
        return "per-step times from CUDA events at step begin/end, no synchronisation per step"
    return "per-step times from the host clock at step begin/end, no synchronisation per step"


def headline_rows(found: Comparison) -> list[tuple[str, str, str, str]]:
    """The two headline rows: (measure, stock, safe, safe / stock)."""
    return [
        (
            "whole run, mean of the runs (ratio of the sums)",
            f"{found.mean_run('stock'):.2f} s",
            f"{found.mean_run('safe'):.2f} s",
            f"{found.whole_ratio:.3f}",
        ),
        (
            "step time, median (per-step median ratio)",
            f"{found.median_step('stock') * 1e3:.1f} ms",
            f"{found.median_step('safe') * 1e3:.1f} ms",
            f"{found.step_ratio:.3f}",
        ),
    ]


__all__ = [
    "Comparison", "KINDS", "SnapshotAccount", "headline_rows", "interleave", "run_shape", "snapshot_account",
    "step_clock_note",
]
