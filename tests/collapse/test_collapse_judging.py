"""The collapse watch's decisions on their own (`collapse/signals.py`, `collapse/watch.py`): a stationary noisy series
within its band never starts an episode, a series that falls (or rises) to its collapsed level does, after
`patience` points; one report per episode; the step's values read from TRL's metric lists with no host read; the
settings validated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from host_reads import HostReads  # tests/ is on sys.path

from safe_trainers.arguments import SafetyArguments
from safe_trainers.collapse import SIGNAL_NAMES, SIGNALS
from safe_trainers.collapse.watch import CollapseWatch, StepMetrics

WINDOW, PATIENCE = 16, 3
# Each signal: (a level of a clean run, the level it collapses to).
LEVELS = {
    "entropy": (3.0, 0.2),
    "reward_std": (0.8, 0.0),
    "frac_reward_zero_std": (0.1, 1.0),
    "kl": (0.02, 1.5),
    "completion_length": (40.0, 4.0),
    "reward": (2.0, -1.0),
}


# The widest band of clean noise (a fraction of the level; of 1 for the fraction) no signal may alarm on: a band of
# +-b around the level can put the window's median at (1+b) and a value at (1-b) of it, which `relative` must allow.
BANDS = {"entropy": 0.1, "reward_std": 0.2, "frac_reward_zero_std": 0.2, "kl": 0.2, "completion_length": 0.2,
         "reward": 0.2}  # fmt: skip


def watch_of(name: str) -> tuple[CollapseWatch, list]:
    reports: list = []
    watch = CollapseWatch([name], WINDOW, PATIENCE, report=lambda *a: reports.append(a))
    return watch, reports


def feed(watch: CollapseWatch, key: str, values: list[float], start: int = 1) -> None:
    for step, value in enumerate(values, start=start):
        watch.step_end(step, {key: [value]})
        watch.metrics.logged()  # `logging_steps=1`: TRL's `log` clears its lists after every step


def test_every_signal_has_levels_here():
    assert set(LEVELS) == set(BANDS) == set(SIGNAL_NAMES)
    for rule in SIGNALS:  # the band is one the signal's relative margin allows (see `BANDS`)
        b = BANDS[rule.name]
        assert rule.relative == 0 or (1 - b) > (1 + b) * (1 - rule.relative) or rule.direction == "up"


@given(
    name=st.sampled_from(SIGNAL_NAMES),
    band=st.floats(0.0, 1.0),
    noise=st.lists(st.floats(-1.0, 1.0), min_size=60, max_size=60),
)
def test_a_stationary_series_within_its_band_never_alarms(name, band, noise):
    """Values within the signal's band around the clean level (`BANDS`), in any order: no episode."""
    rule = next(s for s in SIGNALS if s.name == name)
    level = LEVELS[name][0]
    spread = band * BANDS[name] * (1.0 if name == "frac_reward_zero_std" else level)
    watch, reports = watch_of(name)
    feed(watch, rule.key, [max(0.0, level + spread * n) for n in noise])
    assert reports == [] and watch.episodes == []


@given(name=st.sampled_from(SIGNAL_NAMES), noise=st.lists(st.floats(-1.0, 1.0), min_size=40, max_size=40))
def test_a_series_that_collapses_is_flagged_after_patience_points(name, noise):
    rule = next(s for s in SIGNALS if s.name == name)
    level, collapsed = LEVELS[name]
    spread = 0.1 * (1.0 if name == "frac_reward_zero_std" else level)
    watch, reports = watch_of(name)
    clean = [max(0.0, level + spread * n) for n in noise]
    feed(watch, rule.key, clean)
    feed(watch, rule.key, [collapsed] * 10, start=len(clean) + 1)
    assert watch.episodes == [(len(clean) + PATIENCE, name)]  # once, at the patience-th collapsed point
    step, reported, verdict, window, streak = reports[0]
    assert reported.name == name and verdict.value == collapsed and window == WINDOW and streak == PATIENCE


def test_an_episode_ends_when_the_signal_is_back_and_a_new_collapse_is_reported_again():
    watch, reports = watch_of("entropy")
    series = [3.0] * 20 + [0.1] * 5 + [3.0] * PATIENCE + [0.1] * 5
    feed(watch, "entropy", series)
    assert [step for step, _ in watch.episodes] == [20 + PATIENCE, 20 + 5 + PATIENCE + PATIENCE]


def test_a_brief_dip_shorter_than_patience_is_not_reported():
    watch, reports = watch_of("reward_std")
    feed(watch, "reward_std", [0.8] * 20 + [0.0] * (PATIENCE - 1) + [0.8] * 10)
    assert reports == []


def test_the_first_half_window_is_the_level_not_judged():
    """A run whose values fall within its first half-window takes the fallen level as its own: no episode."""
    watch, reports = watch_of("entropy")
    feed(watch, "entropy", [3.0] * 2 + [0.1] * 30)
    assert reports == []


def test_step_values_are_the_new_ones_across_trls_clear_and_tensors_are_never_read():
    """TRL appends host floats and clears its dictionary at each log (new lists on the next append)."""
    metrics: dict = {"entropy": [1.0, 3.0], "kl": [torch.tensor(5.0)]}
    taken = StepMetrics()
    with HostReads() as reads:
        assert taken.take(metrics, ["entropy", "kl", "reward"]) == {"entropy": 2.0}
        metrics["entropy"].append(5.0)
        assert taken.take(metrics, ["entropy"]) == {"entropy": 5.0}
        assert taken.take(metrics, ["entropy"]) == {}  # nothing new this step
        taken.logged()  # TRL's `log`: the callbacks' `on_log`, then the clear
        metrics.clear()
        metrics["entropy"] = [7.0]
        assert taken.take(metrics, ["entropy"]) == {"entropy": 7.0}
        metrics["entropy"].append(float("nan"))
        assert taken.take(metrics, ["entropy"]) == {}  # a NaN is the guard's business
    assert reads.reads == []


def test_collapse_settings_are_validated():
    assert SafetyArguments(collapse_signals="entropy, kl").collapse_signals == ["entropy", "kl"]
    assert SafetyArguments().collapse_signals == ["entropy", "kl", "completion_length"]
    with pytest.raises(ValueError, match=r"`collapse_signals` names unknown signal\(s\) \['entropie'\]"):
        SafetyArguments(collapse_signals=["entropie"])
    with pytest.raises(ValueError, match="`collapse_window` must be an integer >= 4, got 2"):
        SafetyArguments(collapse_window=2)
    with pytest.raises(ValueError, match=r"`collapse_patience` must be an integer from 1 to half of `collapse_window` "
                       r"\(8\), got 9"):  # fmt: skip
        SafetyArguments(collapse_window=16, collapse_patience=9)
