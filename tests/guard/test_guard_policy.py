"""The guard's pure decisions (`safe_trainers.guard.policy`): plain numbers in, a verdict out."""

from __future__ import annotations

from safe_trainers.guard.policy import StepReading, bundled_steps, can_roll_back, judge_window, state_check_step


NAN = float("nan")


def applied(step, loss=0.5, grad_norm=1.0):
    return StepReading(step, loss, grad_norm, bad=False)


def skipped(step):
    return StepReading(step, NAN, NAN, bad=True, bad_ranks=(0,))


def overflow(step):
    return StepReading(step, 0.5, float("inf"), bad=True, overflow=True)


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


def test_a_damaged_state_found_with_no_step_pending_is_numbered_by_the_step_it_was_found_at():
    """GRPO/RLOO's check before a generation: nothing pending, the state non-finite. No fault step, so no step of the
    window gets a bundle; the step the check ran at does (docs/replay.md), and only for that verdict."""
    found = judge_window([], 0, 3, None, state_finite=False)
    assert (found.rollback, found.fault_step) == ("nonfinite_state", None) and bundled_steps(found) == []
    assert state_check_step(found, 5) == 5
    windowed = judge_window([applied(4), applied(5)], 0, 3, None, state_finite=False)
    assert windowed.fault_step == 4 and bundled_steps(windowed) == [4] and state_check_step(windowed, 5) is None
    skips = judge_window([skipped(4), skipped(5), skipped(6)], 0, 3, None)
    assert state_check_step(skips, 6) is None


def test_rollback_budget():
    assert can_roll_back(0, 1) and not can_roll_back(1, 1) and not can_roll_back(0, 0)


def test_overflows_at_unit_scale_are_faults():
    from safe_trainers.guard.policy import unexplained_overflows

    records = [applied(1), overflow(2)]
    assert unexplained_overflows(records, 65536.0) == records and unexplained_overflows(records, None) == records
    converted = unexplained_overflows(records, 1.0)
    assert converted[0] == records[0] and (converted[1].bad, converted[1].overflow) == (True, False)
    assert converted[1].what == ["grad_norm"]
