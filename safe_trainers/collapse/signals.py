"""What a collapse looks like in each metric TRL computes, as data ([`SIGNALS`]), and the pure judgment of one value
against the run's own recent values ([`judge`]).

A value is judged against a window of the run's recent values of the same metric: their median is the level, 1.4826
times their median absolute deviation the scale (a standard deviation for normal noise, robust to a few outliers).
The value has collapsed when it lies past the level, in the signal's direction, by more than the largest of
`z` scales, `relative` times the level and `minimum` (an absolute change, so the tiny noisy values of a small model
or a nearly constant metric never alarm on their own).
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
# On by default: the signals with no false alarm on any clean run measured (`docs/collapse.md`); `reward_std` and
# `frac_reward_zero_std` alarm on a clean run with a sparse 0/1 reward and one group per step, `reward` caught nothing.
DEFAULT_SIGNALS: tuple[str, ...] = ("entropy", "kl", "completion_length")


def signal(name: str) -> Signal:
    """The row of [`SIGNALS`] named `name`."""
    return next(s for s in SIGNALS if s.name == name)


def judge(window: Sequence[float], value: float, rule: Signal) -> Verdict:
    """Judge `value` against `window`, the run's recent values of the same metric (not empty)."""
    level = statistics.median(window)
    scale = MAD_TO_SIGMA * statistics.median(abs(v - level) for v in window)
    margin = max(rule.z * scale, rule.relative * abs(level), rule.minimum)
    threshold = level - margin if rule.direction == "down" else level + margin
    crossed = value < threshold if rule.direction == "down" else value > threshold
    return Verdict(crossed and math.isfinite(value), value, level, scale, threshold)


__all__ = ["DEFAULT_SIGNALS", "SIGNALS", "SIGNAL_NAMES", "Signal", "Verdict", "judge", "signal"]
