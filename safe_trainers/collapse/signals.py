"""What a collapse looks like in each metric TRL computes, as data ([`SIGNALS`]), and the pure judgment of one value
against the run's own recent values ([`judge`]).

A value is judged against a window of the run's recent values of the same metric: their median is the level, 1.4826
times their median absolute deviation the scale (a standard deviation for normal noise, robust to a few outliers).
The value has collapsed when it lies past the level, in the signal's direction, by more than the largest of
`z` scales, `relative` times the level and `minimum` (an absolute change, so the tiny noisy values of a small model
or a nearly constant metric never alarm on their own).

A collapse is a streak of such values ([`needed_streak`]): at least `collapse_patience` in a row, and longer where the
run's own recent values cross now and then by chance (a sparse 0/1 reward whose one group per step is all 0 on some
steps), so that a streak as long comes from that chance about once in `1 / STREAK_CHANCE` steps (the rate is estimated
from the recent values: measured, 1 to 3 times that, `bench/collapse_streaks.py`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Direction = Literal["down", "up"]
MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation in median absolute deviations


@dataclass(frozen=True)
class Signal:
    """One way a run collapses, read from one metric TRL computes.

    Args:
        name (`str`): the signal's name (what `collapse_signals` lists).
        key (`str`): the metric's name in TRL's `_metrics["train"]` (and in the logs).
        direction (`str`): `"down"` (the metric falls toward its collapsed level) or `"up"` (it rises).
        z (`float`): the margin in robust standard deviations of the window.
        relative (`float`): the margin as a fraction of the window's level (`abs(median)`).
        minimum (`float`): the smallest margin, in the metric's own units.
        meaning (`str`): one line on what a collapse of this metric means.
    """

    name: str
    key: str
    direction: Direction
    z: float
    relative: float
    minimum: float
    meaning: str


@dataclass(frozen=True)
class Verdict:
    """The judgment of one value: `crossed` when it lies past `threshold` in the signal's direction."""

    crossed: bool
    value: float
    median: float
    scale: float
    threshold: float


SIGNALS: tuple[Signal, ...] = (
    Signal("entropy", "entropy", "down", z=6.0, relative=0.2, minimum=0.05,
           meaning="the policy's token entropy falls by a fifth of its level or more: sampling turns deterministic"),
    Signal("reward_std", "reward_std", "down", z=0.0, relative=0.9, minimum=0.01,
           meaning="the rewards' spread falls to a tenth of its level: no advantage left to learn from"),
    Signal("frac_reward_zero_std", "frac_reward_zero_std", "up", z=6.0, relative=0.0, minimum=0.5,
           meaning="the fraction of groups whose rewards are all equal jumps up by half or more"),
    Signal("kl", "kl", "up", z=6.0, relative=4.0, minimum=0.05,
           meaning="the KL to the reference model jumps to five times its level (needs `beta > 0`)"),
    Signal("completion_length", "completions/mean_length", "down", z=6.0, relative=0.5, minimum=2.0,
           meaning="the mean completion length halves: completions collapse to a few tokens"),
    Signal("reward", "reward", "down", z=6.0, relative=0.5, minimum=0.5,
           meaning="the mean reward falls by half its level and half a reward unit or more"),
)
SIGNAL_NAMES: tuple[str, ...] = tuple(signal.name for signal in SIGNALS)
# On by default: the signals with no false alarm on any clean run measured (`docs/collapse.md`). `reward_std` and
# `frac_reward_zero_std` are off: with a sparse 0/1 reward and one group per step, their chance streaks still make
# false alarms over long runs (1 to 3 per 10,000 steps, more when the rate shifts); `reward` caught nothing.
DEFAULT_SIGNALS: tuple[str, ...] = ("entropy", "kl", "completion_length")
# The chance, per step, that a clean run's values cross by chance for a whole streak ([`needed_streak`]).
STREAK_CHANCE = 1e-4


def needed_streak(crossed: int, judged: int, patience: int) -> int:
    """How many values past the threshold in a row make a collapse, when `crossed` of the `judged` recent values
    before the streak lie past the same threshold: `patience` when none does (the metric does not cross by chance),
    else the least `n >= patience` with `rate ** n <= STREAK_CHANCE`, the rate estimated as
    `(crossed + 1/2) / (judged + 1)`. One that crossed on a third of 32 values needs 9."""
    if crossed == 0:
        return patience
    rate = (crossed + 0.5) / (judged + 1)
    return max(patience, math.ceil(math.log(STREAK_CHANCE) / math.log(rate) - 1e-9))


def signal(name: str) -> Signal:
    """The row of [`SIGNALS`] named `name`."""
    return next(s for s in SIGNALS if s.name == name)


def judge(window: Sequence[float], value: float, rule: Signal) -> Verdict:
    """Judge `value` against `window`, the run's recent values of the same metric (not empty)."""
    level = statistics.median(window)
    scale = MAD_TO_SIGMA * statistics.median(abs(v - level) for v in window)
    margin = max(rule.z * scale, rule.relative * abs(level), rule.minimum)
    threshold = level - margin if rule.direction == "down" else level + margin
    return Verdict(past(value, threshold, rule.direction), value, level, scale, threshold)


def past(value: float, threshold: float, direction: Direction) -> bool:
    """Whether the finite `value` lies past `threshold` in `direction`."""
    crossed = value < threshold if direction == "down" else value > threshold
    return crossed and math.isfinite(value)


__all__ = [
    "DEFAULT_SIGNALS", "SIGNALS", "SIGNAL_NAMES", "STREAK_CHANCE", "Signal", "Verdict", "judge", "needed_streak",
    "past", "signal",
]  # fmt: skip
