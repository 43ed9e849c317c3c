"""Where the snapshots fall (`SnapshotInterval.snapshot_due`, `policy.inspection_due`): each one a whole interval after
the one before, whichever took it (the interval, a save, an evaluation), whatever the interval did in between.

Plain numbers, no trainer: test_snapshot_interval.py runs the real ones.
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from safe_trainers.arguments import SafetyArguments
from safe_trainers.guard.policy import inspection_due
from safe_trainers.guard.snapshot_interval import SnapshotInterval

CONFIG = SimpleNamespace(save_strategy="no", sync_ref_model=False)


def control(save: bool) -> SimpleNamespace:
    return SimpleNamespace(should_log=False, should_save=save, should_evaluate=False, should_training_stop=False)


def snapshots(steps: int, saves: set[int], intervals: dict[int, int], start: int = 3) -> tuple[list[int], dict]:
    """Run the guard's decision over `steps` steps: a save at each of `saves`, the interval set to `intervals[s]` at
    step `s` (as a decision at the snapshot before would). The snapshot steps, and the interval in force at each."""
    interval = SnapshotInterval(SafetyArguments(nan_snapshot_steps=start, nan_snapshot_budget=0.0))
    interval.start(CONFIG, None, say=False)
    interval.taken(0, None)  # at train start
    in_force = {}
    for step in range(1, steps + 1):
        interval.steps = intervals.get(step, interval.steps)
        in_force[step] = interval.steps
        due = inspection_due(control(step in saves), step, CONFIG, interval.ask(step), 0, start)
        if due is not None and due[1]:
            interval.taken(step, None)
    return interval.taken_at, in_force


def test_a_grown_interval_counts_from_the_snapshot_before():
    # Snapshots every 10; at step 10 the interval grows to 15: the next comes at 25 (not at 15, 5 steps later).
    taken, _ = snapshots(40, saves=set(), intervals={1: 10, 11: 15})
    assert taken == [0, 10, 25, 40]


def test_a_save_moves_the_next_snapshot():
    taken, _ = snapshots(12, saves={4}, intervals={})
    assert taken == [0, 3, 4, 7, 10]


@given(
    steps=st.integers(1, 120),
    saves=st.sets(st.integers(1, 120), max_size=8),
    intervals=st.dictionaries(st.integers(1, 120), st.integers(1, 40), max_size=6),
)
def test_no_snapshot_comes_early_and_none_late(steps, saves, intervals):
    taken, in_force = snapshots(steps, saves, intervals)
    assert taken == sorted(set(taken)) and taken[0] == 0
    for before, after in zip(taken, taken[1:]):
        gap = after - before
        # Not late: no step between two snapshots had its interval's worth of steps since the one before.
        assert all(step - before < in_force[step] for step in range(before + 1, after))
        # Not early: a snapshot sooner than the interval in force is one a save took.
        assert gap >= in_force[after] or after in saves
