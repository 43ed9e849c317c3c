"""How long a streak past the threshold must be to be a collapse (`collapse/signals.py` `needed_streak`): `patience`
where the run's own values never cross, longer where they cross now and then by chance (a sparse 0/1 reward whose one
group per step is all equal on some steps), so that such a run does not alarm while a metric stuck at its collapsed
level still does."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from safe_trainers.collapse.signals import STREAK_CHANCE, needed_streak
from safe_trainers.collapse.watch import CollapseWatch

WINDOW, PATIENCE = 32, 3


@given(judged=st.integers(0, 256), share=st.floats(0, 1), patience=st.integers(1, 16))
def test_the_streak_needed_is_the_shortest_that_chance_gives_rarely_enough(judged, share, patience):
    crossed = round(share * judged)
    needed = needed_streak(crossed, judged, patience)
    if crossed == 0:  # a metric that does not cross by chance: `collapse_patience` means what it says
        assert needed == patience
        return
    rate = (crossed + 0.5) / (judged + 1)
    assert needed >= patience and rate**needed <= STREAK_CHANCE * (1 + 1e-9)
    assert needed == patience or rate ** (needed - 1) > STREAK_CHANCE  # no longer than it must be
    if crossed < judged:
        assert needed_streak(crossed + 1, judged, patience) >= needed  # crossing more often asks for more


def test_a_metric_that_never_crossed_needs_only_patience_whatever_the_window():
    assert needed_streak(0, 16, PATIENCE) == needed_streak(0, WINDOW, PATIENCE) == PATIENCE
    assert needed_streak(0, 2, 1) == 1  # `collapse_patience=1` with the smallest window: the first value past it


def sparse_reward_std(steps: int, all_equal: float, seed: int) -> list[float]:
    """`reward_std` of a sparse 0/1 reward with one group per step: 0 when the group is all equal (a chance of
    `all_equal` per step), else a spread like 0.35."""
    rng = random.Random(seed)
    return [0.0 if rng.random() < all_equal else 0.35 + 0.05 * rng.random() for _ in range(steps)]


def episodes_of(values: list[float], signal: str = "reward_std") -> list[tuple[int, str, int]]:
    reports: list = []
    watch = CollapseWatch([signal], WINDOW, PATIENCE, report=lambda step, rule, v, w, streak: reports.append(streak))
    for step, value in enumerate(values, start=1):
        watch.step_end(step, {signal: [value]})
        watch.metrics.logged()
    return [(step, name, streak) for (step, name), streak in zip(watch.episodes, reports)]


def test_a_sparse_reward_whose_groups_are_all_equal_on_a_third_of_the_steps_does_not_alarm():
    """Over 3 x 400 steps, 0s come in runs of up to 7 by chance (patience alone would alarm many times)."""
    for seed in range(3):
        values = sparse_reward_std(400, 1 / 3, seed)
        longest = max(len(run) for run in "".join("0" if v == 0 else "1" for v in values).split("1"))
        assert longest > PATIENCE  # the case patience alone takes for a collapse
        assert episodes_of(values) == []


def streak_start(values: list[float], end: int, collapsed: float) -> int:
    """The first step (1-based) of the run of `collapsed` values that ends the first `end` values."""
    start = end
    while start > 0 and values[start - 1] == collapsed:
        start -= 1
    return start + 1


def test_a_sparse_reward_turning_constant_is_reported_once_the_streak_outlasts_chance():
    """The same run, then every reward equal from step 201 (`reward_std` 0 from then on): one episode, when the streak
    (with the chance 0s just before step 201) reaches the length the 32 values before it ask for; within 10 steps."""
    values = sparse_reward_std(200, 1 / 3, 0) + [0.0] * 30
    [(step, name, streak)] = episodes_of(values)
    start = streak_start(values, 200, 0.0)
    before = values[start - 1 - WINDOW : start - 1]
    assert streak == needed_streak(before.count(0.0), WINDOW, PATIENCE) > PATIENCE
    assert name == "reward_std" and step == start + streak - 1 and step - 200 <= 10


def test_a_dense_reward_turning_constant_is_reported_after_patience():
    rng = random.Random(0)
    values = [0.8 + 0.1 * rng.random() for _ in range(100)] + [0.0] * 10
    assert episodes_of(values) == [(100 + PATIENCE, "reward_std", PATIENCE)]


def test_the_fraction_of_equal_groups_of_a_sparse_reward_does_not_alarm_and_a_constant_reward_does():
    """`frac_reward_zero_std` of one group per step is 0 or 1: 1 on a third of the clean steps, then 1 for good."""
    rng = random.Random(1)
    clean = [float(rng.random() < 1 / 3) for _ in range(300)]
    assert episodes_of(clean, "frac_reward_zero_std") == []
    values = clean + [1.0] * 30
    [(step, _, streak)] = episodes_of(values, "frac_reward_zero_std")
    start = streak_start(values, 300, 1.0)
    before = values[start - 1 - WINDOW : start - 1]
    assert streak == needed_streak(before.count(1.0), WINDOW, PATIENCE) > PATIENCE and step == start + streak - 1


def test_an_episode_values_do_not_count_as_the_run_s_own_chance_crossings():
    """Invariant: `recent` holds the run's values outside streaks and episodes, so the streak a collapse needs after an
    episode is the one the values before it asked for. A sparse reward (every other pair of steps all equal: 16 of
    the last 32 cross, a streak of 14 needed), a real collapse (20 zeros: one episode), a recovery that alternates
    (in-band, 0) before 3 in-band steps end the episode, then 13 zeros by chance: shorter than the run's own 14. Found
    in review: the episode's in-band values joined `recent` while its crossed ones did not, so after an episode the
    run looked as if it rarely crossed (9 needed) and the chance streak was reported as a second collapse."""
    clean = [0.4, 0.45, 0.0, 0.0] * 16
    needed = needed_streak(clean[-WINDOW:].count(0.0), WINDOW, PATIENCE)
    assert needed == 14
    values = clean + [0.0] * 20 + [0.4, 0.0] * 8 + [0.4] * 3 + [0.0] * (needed - 1)
    start = streak_start(values, len(clean), 0.0)  # the clean run ends with 2 zeros: the collapse's streak starts there
    assert episodes_of(values) == [(start + needed - 1, "reward_std", needed)]


def test_a_long_clean_sparse_run_alarms_about_as_rarely_as_the_streak_chance_says():
    """A sparse reward, one group per step, all equal on half the steps, 100 000 steps: the rate of chance streaks
    reported is near `STREAK_CHANCE` per step, at most 3 times it (the rate is estimated from 32 values, and a low
    count lets a shorter streak through: measured in review, 1 to 3.2 per 10 000 steps for a chance of 0.1 to 0.6,
    `bench/collapse_streaks.py`). What keeps `reward_std` and `frac_reward_zero_std` off by default."""
    steps = 100_000
    assert 0 < len(episodes_of(sparse_reward_std(steps, 1 / 2, 0))) <= 3 * steps * STREAK_CHANCE
