"""The snapshot interval's own account (`guard/snapshot_interval.py`): the steps of the snapshots it was told of
(`taken_at`), the wall seconds of snapshot work (`spent_seconds`, what the debt weighs against the aimed share of the
budget), and the `overhead` its `snapshot_interval` events report, across a rollback and a new `train()` call.

With plain numbers and a stand-in source (no trainer): the real runs are in test_snapshot_interval.py.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from safe_trainers.arguments import SafetyArguments
from safe_trainers.guard.snapshot_interval import AIM, SnapshotInterval
from safe_trainers.runtime.events import EventLog

PORT = type("Port", (), {"device": "cpu"})()


class Source:
    """A [`RollbackSource`]'s figures: no allocation, no device delay."""

    def allocation_seconds(self) -> float:
        return 0.0

    def copy_delay_seconds(self) -> float | None:
        return 0.0


def started(save_steps: int = 10_000, budget: float = 0.01) -> SnapshotInterval:
    interval = SnapshotInterval(SafetyArguments(nan_snapshot_budget=budget))
    interval.start(type("Config", (), {"save_strategy": "steps", "save_steps": save_steps})(), None, say=False)
    return interval


def snapshot(interval: SnapshotInterval, step: int, seconds: float, events: EventLog) -> None:
    """A snapshot of `step` whose check and copy take `seconds` (slept: the account is wall time)."""
    with interval.timed():
        time.sleep(seconds)
    state = type("State", (), {"global_step": step, "max_steps": 1000})()
    interval.after_snapshot(state, Source(), PORT, events)


def test_a_check_that_ends_in_a_rollback_is_snapshot_work(tmp_path):
    # At a snapshot's inspection the state is checked (timed as snapshot work), a bad step is found and the last good
    # state restored: no copy follows. The check's seconds were spent all the same; `restart` dropped them.
    events = EventLog(str(tmp_path), write=False)
    interval = started()
    snapshot(interval, 0, 0.02, events)
    before = interval.spent_seconds
    with interval.timed():  # the inspection's check, then the rollback
        time.sleep(0.03)
    interval.restart()
    assert interval.spent_seconds >= before + 0.03
    assert interval.taken_at == [0]  # no snapshot was taken
    snapshot(interval, 6, 0.0, events)  # the next snapshot after the restore: its cost is its own
    assert interval.taken_at == [0, 6] and interval.spent_seconds >= before + 0.03


def test_a_new_train_call_starts_a_new_account(tmp_path):
    events = EventLog(str(tmp_path), write=False)
    interval = started()
    snapshot(interval, 0, 0.01, events)
    snapshot(interval, 10, 0.01, events)
    assert interval.taken_at == [0, 10] and interval.spent_seconds >= 0.02
    interval.start(type("Config", (), {"save_strategy": "steps", "save_steps": 10_000})(), None, say=False)
    assert interval.taken_at == [] and interval.spent_seconds == 0.0
    snapshot(interval, 10, 0.0, events)  # a resumed run's first snapshot: at its checkpoint's step
    assert interval.taken_at == [10]


def test_the_debt_counts_against_the_aimed_share_of_the_budget(tmp_path):
    interval = started(budget=0.5)
    snapshot(interval, 0, 0.05, EventLog(str(tmp_path), write=False))
    before = time.perf_counter() - interval._began  # the time since the start, just before and just after
    debt = interval.debt()
    after = time.perf_counter() - interval._began
    spent = interval.spent_seconds  # ~50 ms, over ~50 ms: 12.5 ms allowed at half of 50%, 25 ms at the whole
    assert spent - AIM * 0.5 * after <= debt <= spent - AIM * 0.5 * before


@given(
    figures=st.lists(
        st.tuples(st.floats(1e-4, 10), st.floats(1e-4, 10), st.floats(0, 10)), min_size=1, max_size=8
    ),
    budget=st.floats(1e-3, 0.5),
    lower=st.integers(1, 50),
    upper=st.integers(1, 5000),
)
def test_each_events_overhead_is_within_the_aim_unless_the_checkpoint_interval_caps_it(figures, budget, lower, upper):
    # The `overhead` of a `snapshot_interval` event is the median snapshot cost over the interval's steps' time: at
    # most half the budget (the aim), the debt left out of it (it only stretches the interval), except where
    # `save_steps` holds the interval below what the figures ask for.
    events = EventLog("unused", write=False)
    interval = SnapshotInterval(SafetyArguments(nan_snapshot_budget=budget, nan_snapshot_steps=lower))
    interval.start(type("Config", (), {"save_strategy": "steps", "save_steps": upper})(), None, say=False)
    for step, (cost, step_time, debt) in enumerate(figures, start=1):
        interval.decide(step * 10, (cost, step_time, debt), events, estimated=step == 1)
    for detail in (event.detail for event in events.events):
        share = detail["snapshot_seconds"] / (detail["interval"] * detail["step_seconds"])
        assert detail["overhead"] == pytest.approx(share)
        if detail["interval"] < max(lower, upper):
            assert detail["overhead"] <= AIM * budget * (1 + 1e-9), detail


# --------------------------------------------------------------------------------------------------------------------
# Real trainers: the account against the snapshots a callback saw (test_snapshot_interval.py's `run` and `Watch`)
# --------------------------------------------------------------------------------------------------------------------


def test_the_account_across_a_rollback_a_resume_and_a_second_train_call(toy_models, tmp_path):
    from test_snapshot_interval import Watch

    from safe_trainers.guard import read_events
    from safe_trainers.testing.build import build_trainer
    from safe_trainers.testing.faults import Fault

    out = tmp_path / "out"
    config = dict(max_steps=9, save_steps=4, nan_snapshot_steps=3, nan_snapshot_budget=0.0)
    trainer = build_trainer("sft", toy_models["qwen2"], out, preset="guarded", faults=[Fault(7, "weight")], **config)
    watch = Watch(trainer)
    trainer.add_callback(watch)
    trainer.train()
    account = trainer.nan_guard.interval
    [rollback] = [e for e in read_events(str(out)) if e["kind"] == "rollback"]
    assert rollback["restored_step"] in watch.snapshots  # the restore took no snapshot: none in the account
    assert sorted(set(account.taken_at)) == watch.snapshots and account.taken_at == sorted(account.taken_at)
    first = (list(account.taken_at), account.spent_seconds)
    assert first[1] > 0

    watch.snapshots.clear()
    trainer.train()  # a second call on the same trainer: its own account, from its own start
    assert account.taken_at[0] == 0 and sorted(set(account.taken_at)) == watch.snapshots

    resumed = build_trainer("sft", toy_models["qwen2"], out, preset="guarded", **config)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-8"))
    again = resumed.nan_guard.interval
    assert again.taken_at[0] == 8 and all(step >= 8 for step in again.taken_at) and again.spent_seconds > 0
