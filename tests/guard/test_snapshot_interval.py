"""The adaptive snapshot interval (`guard/snapshot_interval.py`): snapshots (a state check and a host copy) take at
most `nan_snapshot_budget` of the run's wall time, at least `nan_snapshot_steps` and at most `save_steps` apart.

The decision is a pure function of plain numbers (tested here directly and as a property); on real trainers the
figures are measured: the budget and a callback that makes every step sleep set where the measured figures must land,
without timing anything in the test itself.
"""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import TrainerCallback

from safe_trainers.arguments import SafetyArguments
from safe_trainers.guard import read_events
from safe_trainers.guard.snapshot_interval import (
    AIM,
    SnapshotInterval,
    checkpoint_interval,
    choose_interval,
    describe,
    next_interval,
)
from safe_trainers.runtime.events import EventLog
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


# --------------------------------------------------------------------------------------------------------------------
# The decision, with plain numbers
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cost, step_time, budget, lower, upper, expected",
    [
        (0.156, 0.181, 0.01, 1, None, 173),  # the H100 figures of issue 30: at half the budget, 172.4 steps -> 173
        (0.156, 0.181, 0.01, 1, 50, 50),  # capped by the checkpoint interval
        (0.001, 1.0, 0.01, 1, 500, 1),  # a cheap snapshot: every step
        (0.001, 1.0, 0.01, 5, 500, 5),  # but never below `nan_snapshot_steps`
        (0.156, 0.181, 0.0, 7, 50, 7),  # budget 0: the fixed interval
        (0.0, 0.181, 0.01, 3, 50, 3),  # a free snapshot
        (0.2, 0.0, 0.01, 3, 50, 50),  # no step time measured: as rare as allowed
        (0.2, 0.1, 0.01, 20, 10, 20),  # bounds crossed: the lower bound (the user's) wins
    ],
)
def test_choose_interval(cost, step_time, budget, lower, upper, expected):
    assert choose_interval(cost, step_time, budget, lower, upper) == expected


def test_next_interval_grows_at_once_and_shrinks_only_by_a_margin():
    assert next_interval(10, 11) == 11  # the budget needs it
    assert next_interval(10, 9) == 10  # within the margin: kept (costs less than the budget)
    assert next_interval(10, 8) == 8  # 10 / 8 = 1.25: shrinks


@given(
    cost=st.floats(0, 100, allow_nan=False),
    step_time=st.floats(1e-6, 100, allow_nan=False),
    budget=st.floats(1e-4, 0.99),
    lower=st.integers(1, 1000),
    upper=st.one_of(st.none(), st.integers(1, 10_000)),
    current=st.integers(1, 10_000),
)
def test_the_interval_is_within_bounds_and_within_budget_when_the_bounds_allow(
    cost, step_time, budget, lower, upper, current
):
    chosen = choose_interval(cost, step_time, budget, lower, upper)
    top = max(lower, upper) if upper is not None else math.inf
    assert lower <= chosen <= top
    current = min(max(current, lower), top)  # the interval kept is always within the bounds
    kept = next_interval(current, chosen)
    assert lower <= kept <= top
    needed = cost / (AIM * budget * step_time)
    if needed <= top:  # the bounds allow the aim: the snapshots' share of the wall time is within half the budget
        assert cost / (kept * step_time) <= AIM * budget * (1 + 1e-9)


def settings(**values) -> SafetyArguments:
    return SafetyArguments(**values)


def test_the_interval_decides_from_the_medians_and_records_each_change(tmp_path):
    events = EventLog(str(tmp_path), write=True)
    interval = SnapshotInterval(settings(nan_snapshot_budget=0.01))
    config = type("Config", (), {"save_strategy": "steps", "save_steps": 200})()
    interval.start(config, None, say=False)
    assert (interval.steps, interval.read_steps, interval.lower, interval.upper) == (10, 10, 1, 200)
    interval.decide(10, (0.05, 0.1), events)  # 100 steps (aimed at half the budget)
    interval.decide(60, (5.0, 0.1), events)  # an outlier: the median of (0.05, 5.0) asks for 5050 -> 200
    interval.decide(260, (0.05, 0.1), events)  # median 0.05 again: 100, 2x shorter: shrinks
    interval.decide(310, (0.051, 0.1), events)  # median 0.0505: 101, grows at once
    got = [(e.step, e.detail["previous"], e.detail["interval"]) for e in events.events]
    assert got == [(10, 10, 100), (60, 100, 200), (260, 200, 100), (310, 100, 101)]
    assert [e.kind for e in events.events] == ["snapshot_interval"] * 4 and not any(e.nonfinite for e in events.events)
    assert read_events(str(tmp_path))[0]["snapshot_seconds"] == 0.05


def test_settings_unset_set_and_fixed():
    assert describe(settings(), type("C", (), {"save_strategy": "steps", "save_steps": 500})()) == (
        "snapshots adapt to <= 1% of wall time, every 1-500 steps"
    )
    assert describe(settings(nan_snapshot_steps=4), type("C", (), {"save_strategy": "epoch"})()) == (
        "snapshots adapt to <= 1% of wall time, every >= 4 steps"
    )
    assert describe(settings(nan_snapshot_budget=0), None) == "snapshot every 10 steps"
    fixed = SnapshotInterval(settings(nan_snapshot_steps=30, nan_snapshot_budget=0))
    fixed.start(type("C", (), {"save_strategy": "steps", "save_steps": 4})(), None, say=False)
    assert fixed.steps == 30 and not fixed.adaptive  # today's fixed interval, whatever the saves
    assert checkpoint_interval(type("C", (), {"save_strategy": "steps", "save_steps": 0.5})(), None) is None


# --------------------------------------------------------------------------------------------------------------------
# Real trainers
# --------------------------------------------------------------------------------------------------------------------


class Watch(TrainerCallback):
    """After the guard's callback: the steps of the snapshots taken, and the flags left unread after each step; every
    step sleeps `sleep` seconds (inside the step's wall time, as slow compute would)."""

    def __init__(self, trainer, sleep: float = 0.0):
        self.trainer, self.sleep = trainer, sleep
        self.snapshots: list[int] = []
        self.unread: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(self.sleep)

    def on_step_end(self, args, state, control, **kwargs):
        guard = self.trainer.nan_guard
        step = guard.snapshotter.snapshot.step
        if step >= 0 and (not self.snapshots or self.snapshots[-1] != step):
            self.snapshots.append(step)
        self.unread.append(len(guard.flags.pending))


def run(tmp_path, model, sleep: float = 0.0, faults=(), **config):
    trainer = build_trainer("sft", model, tmp_path / "out", preset="guarded", faults=faults, **config)
    watch = Watch(trainer, sleep)
    trainer.add_callback(watch)
    trainer.train()
    events = read_events(trainer.args.output_dir)
    return watch, [e for e in events if e["kind"] == "snapshot_interval"], events


def test_costly_snapshots_stretch_to_the_checkpoint_interval(toy_models, tmp_path):
    # A budget no snapshot fits in: the interval goes to its upper bound, `save_steps`, at the first decision, an
    # estimate at step 2 before the second snapshot would be taken (so none is); the flags are still read every
    # `nan_snapshot_steps`, and a rollback goes back to the last snapshot (at most 6 steps).
    watch, chosen, events = run(
        tmp_path, toy_models["qwen2"], max_steps=20, save_steps=6, nan_snapshot_steps=2, nan_snapshot_budget=1e-6,
        faults=[Fault(step=9, kind="weight")],
    )  # fmt: skip
    got = [(e["step"], e["previous"], e["interval"], e["lower"], e["upper"], e["estimated"]) for e in chosen]
    assert got == [(2, 2, 6, 2, 6, True)]
    assert chosen[0]["snapshot_seconds"] > 0 and chosen[0]["step_seconds"] > 0 and chosen[0]["budget"] == 1e-6
    assert watch.snapshots == [0, 6, 12, 18, 20]  # the start, then every 6 (a rollback's target)
    assert max(watch.unread) < 2  # the flag reads kept their cadence
    [rollback] = [e for e in events if e["kind"] == "rollback"]
    assert rollback["restored_step"] == 6


def test_slow_steps_keep_the_lower_bound(toy_models, tmp_path):
    # Steps of over 50 ms and a budget of 90%: one snapshot of this tiny model would fit every step, but
    # `nan_snapshot_steps=3` is the least (estimated at step 3, then measured at each snapshot: no change).
    watch, chosen, _ = run(
        tmp_path, toy_models["qwen2"], sleep=0.05, max_steps=9, save_steps=100, nan_snapshot_steps=3,
        nan_snapshot_budget=0.9,
    )  # fmt: skip
    got = [(e["step"], e["interval"], e["lower"], e["upper"], e["estimated"]) for e in chosen]
    assert got == [(3, 3, 3, 100, True)]
    assert chosen[0]["step_seconds"] >= 0.05  # measured from the real steps, their sleep included
    assert watch.snapshots == [0, 3, 6, 9]


def test_the_interval_follows_the_measured_figures(toy_models, tmp_path):
    # Unset `nan_snapshot_steps`: start at 10, adapt from 1 (estimated at step 10 from the first snapshot's cost, then
    # measured at each snapshot). Whatever this machine measures, the interval is the one the recorded figures give,
    # and the snapshots follow it.
    watch, chosen, _ = run(
        tmp_path, toy_models["qwen2"], sleep=0.02, max_steps=24, save_steps=1000, nan_snapshot_steps=None,
        nan_snapshot_budget=0.05,
    )  # fmt: skip
    first = chosen[0]
    assert (first["step"], first["previous"], first["lower"], first["upper"]) == (10, 10, 1, 1000)
    assert first["estimated"]
    cost = first["snapshot_seconds"] + first["debt_seconds"]  # the first snapshot's time beyond the budget, if any
    assert first["interval"] == next_interval(10, choose_interval(cost, first["step_seconds"], 0.05, 1, 1000))
    assert first["step_seconds"] >= 0.02 and first["snapshot_seconds"] > 0
    assert first["overhead"] <= 0.05
    assert not any(e["estimated"] for e in chosen[1:])  # every later decision is measured at a snapshot
    # The interval in force at a step is the last one chosen before it (or estimated at it, before its snapshot).
    in_force = {
        s: [e["interval"] for e in chosen if e["step"] < s or (e["step"] == s and e["estimated"])][-1]
        for s in range(10, 24)
    }
    # Each snapshot comes a whole interval after the one before (not on multiples of the interval).
    expected, last = [], 0
    for step in range(10, 24):
        if step - last >= in_force[step]:
            expected.append(step)
            last = step
    assert watch.snapshots[0] == 0 and [s for s in watch.snapshots if 10 <= s < 24] == expected


def test_budget_zero_keeps_the_fixed_interval(toy_models, tmp_path):
    watch, chosen, _ = run(
        tmp_path, toy_models["qwen2"], max_steps=9, save_steps=100, nan_snapshot_steps=3, nan_snapshot_budget=0.0
    )
    assert chosen == [] and watch.snapshots == [0, 3, 6, 9]
    interval = watch.trainer.nan_guard.interval  # its own account, which the benches print
    assert sorted(set(interval.taken_at)) == watch.snapshots and interval.spent_seconds > 0


@pytest.mark.distributed
def test_two_ranks_agree_on_the_interval(tmp_path):
    # Each rank measures its own figures; the largest of each is agreed at the snapshot, so both ranks choose the same
    # interval from the same figures (their inspections and collectives must line up) and train alike.
    from test_guard_distributed import accelerate_ddp, check_in_sync, launch

    # The interval starts at 6 (`save_steps`); the snapshot of step 6 allocates the moments' buffers, so the first
    # decision is at step 12.
    extra = ["--max_steps", "14", "--save_steps", "6", "--snapshot_budget", "0.01", "--snapshot_steps", "-1"]
    results = launch(accelerate_ddp(), "dpo", [], tmp_path, *extra)
    check_in_sync(results, 0, 0, tmp_path / "out")
    assert all(r["global_step"] == 14 for r in results)
    ranks = [r["intervals"] for r in results]
    assert ranks[0] and ranks[0] == ranks[1], ranks  # the figures too, not only the intervals
    assert all(1 <= e["interval"] <= 6 and e["upper"] == 6 for e in ranks[0])


def test_the_buffers_allocation_is_not_counted_as_a_snapshot_cost(toy_models, tmp_path):
    # The snapshot at step 2 is the first with AdamW's moments: it allocates their host buffers (and, on a GPU,
    # page-locks them), a one-time cost of several copies (~3x a copy on this CPU, far more with pinning). Counted, it
    # would stretch the interval: the source reports it (`allocation_seconds`) and the interval leaves it out.
    trainer = build_trainer(
        "sft", toy_models["qwen2"], tmp_path / "out", preset="guarded", max_steps=4, save_steps=100,
        nan_snapshot_steps=2, nan_snapshot_budget=0.9,
    )  # fmt: skip
    allocations = []

    class Allocations(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            source = trainer.nan_guard.snapshotter
            allocations.append((state.global_step, source.snapshot.step, source.allocation_seconds()))

    trainer.add_callback(Allocations())
    trainer.train()
    at_two = [a for step, snap, a in allocations if step == 2 and snap == 2]
    at_four = [a for step, snap, a in allocations if step == 4 and snap == 4]
    assert at_two and at_two[0] > 0  # the moments' buffers were allocated (and their pages mapped) at step 2
    assert at_four and at_four[0] == 0.0  # reused at step 4


class FakeSource:
    def __init__(self, allocation: float = 0.0, delay: float | None = 0.0):
        self.allocation, self.delay = allocation, delay

    def allocation_seconds(self) -> float:
        return self.allocation

    def copy_delay_seconds(self) -> float | None:
        return self.delay


def test_the_estimate_scales_the_first_cost_to_the_state_and_adds_the_allocation_of_what_it_gained(tmp_path):
    # The first snapshot's own cost leaves its allocation out (a one-time cost), but the next snapshot allocates the
    # buffers of what the state gained since (the moments): the estimate adds that at the first allocation's rate.
    events = EventLog(str(tmp_path), write=True)
    interval = SnapshotInterval(settings(nan_snapshot_budget=0.01))
    config = type("Config", (), {"save_strategy": "steps", "save_steps": 10_000})()
    held = [100]  # the state's bytes: the weights at the first snapshot, 3x once the moments exist
    interval.start(config, None, say=False, held=lambda: held[0])
    state = type("State", (), {"global_step": 0, "max_steps": 1000})()
    port = type("Port", (), {"device": "cpu"})()
    began = time.perf_counter()
    with interval.timed():
        time.sleep(0.03)  # the check and the copy, 20 ms of which allocating (left out)
    took = time.perf_counter() - began  # at least 30 ms, more on a loaded machine
    interval.after_snapshot(state, FakeSource(allocation=0.02, delay=0.0), port, events)
    cost = interval._first[0]
    assert cost == pytest.approx(took - 0.02, abs=0.002) and cost > 0.009
    held[0] = 300
    interval.estimate(9, FakeSource(delay=0.005), port, events)  # not at the start interval's step: nothing
    assert not interval.decided and not events.events
    interval.estimate(10, FakeSource(delay=0.005), port, events)  # the first copy's device delay, known by now
    [event] = events.events
    assert event.step == 10 and event.detail["estimated"]
    assert event.detail["snapshot_seconds"] == pytest.approx((cost + 0.005) * 3 + 0.02 * (300 - 100) / 100)
    debt = event.detail["debt_seconds"]  # the first snapshot's 30 ms beyond 0.5% of the time since the start
    assert 0 < debt <= took
    expected = choose_interval(event.detail["snapshot_seconds"] + debt, event.detail["step_seconds"], 0.01, 1, 10_000)
    assert interval.steps == event.detail["interval"] == next_interval(10, expected)
    assert not interval.costs  # an estimate is not one of the measured figures
    interval.estimate(20, FakeSource(), port, events)  # decided: no second estimate
    assert len(events.events) == 1


def test_one_time_costs_are_paid_back_by_a_longer_interval(tmp_path):
    # The first snapshot took 50 ms, 40 of them allocating its buffers: left out of its cost figure, but not out of
    # the budget. The next interval stretches until 0.5% of the run's time (the aim, half of 1%) has paid for it.
    events = EventLog(str(tmp_path), write=True)
    interval = SnapshotInterval(settings(nan_snapshot_budget=0.01))
    interval.start(type("Config", (), {"save_strategy": "steps", "save_steps": 10_000})(), None, say=False)
    state = type("State", (), {"global_step": 0, "max_steps": 1000})()
    began = time.perf_counter()
    with interval.timed():
        time.sleep(0.05)
    took = time.perf_counter() - began
    interval.after_snapshot(state, FakeSource(allocation=0.04), type("Port", (), {"device": "cpu"})(), events)
    interval.decide(10, (0.001, 0.1, interval.debt()), events)  # alone, 1 ms and 100 ms a step: every step
    [event] = events.events
    assert took - 0.01 <= event.detail["debt_seconds"] <= took  # all of it but 0.5% of the time since the start
    # (1 + at least 40 ms) / (half of 1% x 100 ms)
    assert interval.steps == choose_interval(0.001 + event.detail["debt_seconds"], 0.1, 0.01, 1, 10_000) >= 82
