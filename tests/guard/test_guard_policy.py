"""The guard's pure decisions (`safe_trainers.guard.policy`): plain numbers in, a verdict out."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st_

from safe_trainers.guard.policy import SpikeDetector, StepRecord, can_roll_back, judge_window


NAN = float("nan")


def applied(step, loss=0.5, grad_norm=1.0):
    return StepRecord(step, loss, grad_norm, bad=False)


def skipped(step):
    return StepRecord(step, NAN, NAN, bad=True, bad_ranks=(0,))


def overflow(step):
    return StepRecord(step, 0.5, float("inf"), bad=True, overflow=True)


def test_consecutive_skips_roll_back_from_the_first_of_the_run():
    verdict = judge_window([applied(1), skipped(2), skipped(3), skipped(4)], 0, 3, None)
    assert (verdict.rollback, verdict.fault_step, verdict.consecutive) == ("consecutive_skips", 2, 3)
    assert [r.step for r in verdict.skipped] == [2, 3, 4]


def test_a_run_of_skips_continues_across_windows():
    first = judge_window([applied(1), skipped(2), skipped(3)], 0, 3, None)
    assert first.rollback is None and first.consecutive == 2
    assert judge_window([skipped(4)], first.consecutive, 3, None).rollback == "consecutive_skips"


def test_overflows_are_neither_faults_nor_applied_steps():
    # An overflow in the middle of a run of skips neither counts towards it nor breaks it.
    verdict = judge_window([skipped(1), overflow(2), skipped(3), overflow(4), overflow(5)], 0, 3, None)
    assert [r.step for r in verdict.overflows] == [2, 4, 5] and [r.step for r in verdict.skipped] == [1, 3]
    assert verdict.rollback is None and verdict.consecutive == 2


def test_nonfinite_state_rolls_back_even_without_a_skip():
    verdict = judge_window([applied(1), applied(2)], 0, 3, None, state_finite=False)
    assert (verdict.rollback, verdict.fault_step) == ("nonfinite_state", 1)


def test_rollback_budget():
    assert can_roll_back(0, 1) and not can_roll_back(1, 1) and not can_roll_back(0, 0)


def feed(detector, values, grad_norm=1.0):
    return [detector.update(v, grad_norm) for v in values]


@pytest.mark.parametrize("center,spread", [(0.69, 0.01), (0.0, 1e-3), (-0.02, 5e-3), (-3.0, 0.2), (1e4, 300.0)])
def test_spikes_are_found_at_any_sign_and_scale(center, spread):
    rng = random.Random(0)
    detector = SpikeDetector(threshold=6.0, patience=2)
    assert not any(feed(detector, [center + rng.gauss(0, spread) for _ in range(40)]))
    jump = center + 50 * spread
    assert feed(detector, [jump, jump]) == [False, True]


def test_a_spike_in_the_gradient_norm_alone_counts():
    detector = SpikeDetector(threshold=6.0, patience=1)
    rng = random.Random(1)
    for _ in range(30):
        detector.update(0.5 + rng.gauss(0, 0.01), 1.0 + rng.gauss(0, 0.05))
    assert detector.update(0.5, 50.0)


def test_a_history_without_spread_gives_no_verdict():
    # GRPO losses are exactly 0 while every group has equal rewards; the first non-zero loss is not a spike.
    detector = SpikeDetector(threshold=6.0, patience=1)
    feed(detector, [0.0] * 30, grad_norm=0.0)
    assert not detector.update(0.05, 0.3)


def test_ratio_to_the_mean_would_have_fired_on_negative_losses():
    # The old rule (`loss > factor * mean`) fires on every step of a healthy run whose mean is negative.
    losses = [-0.05 + 0.01 * math.sin(i) for i in range(60)]
    assert sum(loss > 3.0 * (sum(losses[:i]) / i) for i, loss in enumerate(losses) if i >= 8) > 40
    assert not any(feed(SpikeDetector(threshold=6.0), losses))


@given(
    st_.lists(st_.floats(-10, 10, allow_nan=False), min_size=20, max_size=80),
    st_.lists(st_.sampled_from([NAN, float("inf"), float("-inf")]), min_size=1, max_size=5),
)
def test_nonfinite_values_never_enter_the_statistics(history, poison):
    detector = SpikeDetector(threshold=6.0, patience=1)
    feed(detector, history)
    before = (list(detector.loss.values), list(detector.grad_norm.values), detector.streak)
    for value in poison:
        assert detector.update(value, 1.0) is False and detector.update(0.0, value) is False
    assert (list(detector.loss.values), list(detector.grad_norm.values), detector.streak) == before


def test_overflows_at_unit_scale_are_faults():
    from safe_trainers.guard.policy import unexplained_overflows

    records = [applied(1), overflow(2)]
    assert unexplained_overflows(records, 65536.0) == records and unexplained_overflows(records, None) == records
    converted = unexplained_overflows(records, 1.0)
    assert converted[0] == records[0] and (converted[1].bad, converted[1].overflow) == (True, False)
    assert converted[1].what == ["grad_norm"]
