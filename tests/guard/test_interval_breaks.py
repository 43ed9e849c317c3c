"""Where the adaptive snapshot interval (`guard/snapshot_interval.py`, issue 30) broke its contract: each test is a
schedule a reviewer found, on plain numbers or a real tiny trainer.

* A valid `nan_snapshot_budget` too small for a float (`1e-320`) made the decision divide to infinity (or by zero) and
  crashed the run at its first decision (`choose_interval`).
* A resumed `train()` started again from the starting interval without a `snapshot_interval` event, while the event
  log kept the decisions of the run before the checkpoint: the log said the snapshots were 1 step apart where they were
  10 (now its first snapshot records the interval it starts with, `resumed: true`).
* The events before a `rollback` did not tell how far it could go, as docs/guard.md said to read them: a decision taken
  at the rollback's own inspection (the first, an estimate) is logged before it, though the fault came under the
  interval before; a first decision that shrinks the interval at a skipped step (no snapshot there) leaves a fault
  after it one longer interval from the snapshot restored. The docs now say which events bound it.
* `nan_snapshot_steps` at or above `save_steps` was reported as a range going down ("every 20-10 steps").
"""

from __future__ import annotations

import time

import pytest
from transformers import TrainerCallback

from safe_trainers.arguments import SafetyArguments
from safe_trainers.guard import read_events
from safe_trainers.guard.snapshot_interval import LONGEST, SnapshotInterval, choose_interval, describe
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


def config(**values):
    return type("Config", (), values)()


# --------------------------------------------------------------------------------------------------------------------
# A budget too small for a float
# --------------------------------------------------------------------------------------------------------------------


def test_a_tiny_budget_stretches_the_interval_to_its_bound():
    # `nan_snapshot_budget` accepts any finite fraction in [0, 1): at 1e-320 the aimed share of a step's time is a
    # subnormal float, and the steps one snapshot needs overflow to infinity (`ceil` of it raised OverflowError); at
    # 5e-324 it is 0 (ZeroDivisionError). No snapshot fits such a budget: the interval is its upper bound.
    assert choose_interval(0.01, 0.1, 1e-320, 1, 6) == 6
    assert choose_interval(0.01, 0.1, 5e-324, 1, 6) == 6
    assert choose_interval(1.0, 1e-9, 1e-300, 2, None) == LONGEST
    assert choose_interval(0.0, 0.1, 5e-324, 3, 6) == 3  # a free snapshot still fits


def test_a_run_with_a_tiny_budget_trains_to_the_end(toy_models, tmp_path):
    trainer = build_trainer(
        "sft", toy_models["qwen2"], tmp_path / "out", preset="guarded", max_steps=6, save_steps=4,
        nan_snapshot_steps=2, nan_snapshot_budget=1e-320,
    )  # fmt: skip
    trainer.train()  # crashed at step 2 (the first decision) with OverflowError
    assert trainer.state.global_step == 6
    chosen = [e for e in read_events(trainer.args.output_dir) if e["kind"] == "snapshot_interval"]
    assert [(e["step"], e["interval"]) for e in chosen] == [(2, 4)]


# --------------------------------------------------------------------------------------------------------------------
# What the event log says about how far a rollback could go
# --------------------------------------------------------------------------------------------------------------------


class SlowSteps(TrainerCallback):
    """Every step sleeps `sleep` seconds (slow compute): a snapshot of the toy model then costs a small share of a
    step, and the adaptive interval goes down to its lower bound, 1 (unset `nan_snapshot_steps`)."""

    def __init__(self, sleep: float):
        self.sleep = sleep

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(self.sleep)


def train(model, out, faults=(), resume=None, **config):
    trainer = build_trainer("sft", model, out, preset="guarded", faults=faults, **config)
    trainer.add_callback(SlowSteps(0.15))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, read_events(trainer.args.output_dir)


def skips_before(events: list[dict], step: int) -> int:
    """The steps skipped in a row right before `step` (its `skip` events)."""
    skipped, count = {e["step"] for e in events if e["kind"] in ("skip", "spike")}, 0
    while step - count - 1 in skipped:
        count += 1
    return count


def how_far_it_could_go(events: list[dict], rollback: dict, started: int) -> int:
    """How far back `rollback` could go, read from the event log as docs/guard.md says: the longest of the interval in
    force after the snapshot it restores (the last `snapshot_interval` event at or before `restored_step`; none: the
    interval the run `started` with, logged at the start) and any chosen after it before the fault, plus the skipped
    steps in a row before the fault. (It said: the last `snapshot_interval` event before the `rollback`.)"""
    chosen = [e for e in events if e["kind"] == "snapshot_interval"]
    restored, fault = rollback["restored_step"], rollback["fault_step"]
    at = [e["interval"] for e in chosen if e["step"] <= restored]
    since = [e["interval"] for e in chosen if restored < e["step"] < fault]
    return max([at[-1] if at else started, *since]) + skips_before(events, fault)


# The run's settings: the snapshot interval starts at 10 and adapts from 1; a checkpoint at step 12; the flags are read
# every 10 steps (no log before), so a fault is found at the tenth step after the last read.
SETTINGS = dict(save_steps=12, nan_snapshot_steps=None, nan_snapshot_budget=0.9, logging_steps=100)


def test_a_resumed_run_reports_the_interval_it_starts_with(toy_models, tmp_path):
    # The first run decides at step 10 (snapshots every step: cheap against the slow steps) and saves at 12. The run
    # resumed from checkpoint-12 starts again at 10 steps, deciding at 22; a fault at 20 rolls back to 12, 8 steps
    # before it. The event log kept the first run's decision (every step, at step 10) and said nothing more before the
    # fault: read as the docs say, the rollback could go back 1 step (+ skips in a row before the fault: none).
    out = tmp_path / "out"
    first, _ = train(toy_models["qwen2"], out, max_steps=14, **SETTINGS)
    decided = first.nan_guard.interval.steps
    assert decided < 8  # the run before the checkpoint decided a short interval (so the log has one to mislead)
    _, events = train(
        toy_models["qwen2"], out, faults=[Fault(step=20, kind="weight")], resume=str(out / "checkpoint-12"),
        max_steps=26, **SETTINGS,
    )  # fmt: skip
    [rollback] = [e for e in events if e["kind"] == "rollback"]
    assert (rollback["fault_step"], rollback["restored_step"]) == (20, 12)
    reported = how_far_it_could_go(events, rollback, started=10)
    assert rollback["fault_step"] - rollback["restored_step"] <= reported, (reported, events)


def test_the_events_before_a_rollback_tell_how_far_it_could_go(toy_models, tmp_path):
    # A NaN weight at step 5 makes steps 5-10 skip; the flags are read at step 10, where the interval is also first
    # decided (an estimate, before that step's inspection): every step. That event is logged before the rollback its
    # inspection decides (to step 0, 5 steps before the fault): the last `snapshot_interval` event before the
    # `rollback` says 1, though the fault came under the interval the run started with (10).
    _, events = train(toy_models["qwen2"], tmp_path / "out", faults=[Fault(step=5, kind="weight")], max_steps=12,
                      **SETTINGS)  # fmt: skip
    [rollback] = [e for e in events if e["kind"] == "rollback"]
    assert (rollback["step"], rollback["fault_step"], rollback["restored_step"]) == (10, 5, 0)
    decided = [e for e in events if e["kind"] == "snapshot_interval"][0]
    assert decided["step"] == 10 and decided["interval"] < 5  # at the rollback's inspection, before it
    bound = how_far_it_could_go(events, rollback, started=10)
    assert rollback["fault_step"] - rollback["restored_step"] <= bound, (bound, events)


def test_a_shrink_before_a_skipped_snapshot_is_not_the_bound(toy_models, tmp_path):
    # The estimate at step 10 shrinks the interval from 10 to every step; step 10 is skipped (a NaN loss), so no
    # snapshot is taken there, and step 11 leaves a NaN weight: the rollback at 11 goes back to step 0, the interval
    # the run started with (10) plus the skipped step, though the interval in force at the fault is 1. Neither the
    # last event before the rollback nor the last before the fault (1, + 1 skip) tells it.
    faults = [Fault(step=10, kind="loss"), Fault(step=11, kind="update")]
    _, events = train(toy_models["qwen2"], tmp_path / "out", faults=faults, max_steps=12, **SETTINGS)
    [rollback] = [e for e in events if e["kind"] == "rollback"]
    assert (rollback["step"], rollback["fault_step"], rollback["restored_step"]) == (11, 11, 0)
    decided = [e for e in events if e["kind"] == "snapshot_interval"][0]
    assert decided["step"] == 10 and decided["interval"] < 10  # shrunk at the estimate, before step 10's inspection
    assert skips_before(events, 11) == 1
    bound = how_far_it_could_go(events, rollback, started=10)
    assert rollback["fault_step"] - rollback["restored_step"] <= bound, (bound, events)


# --------------------------------------------------------------------------------------------------------------------
# Bounds that cross
# --------------------------------------------------------------------------------------------------------------------


def test_crossed_bounds_are_reported_as_the_interval_kept():
    # `nan_snapshot_steps=20` over `save_steps=10`: the user's lower bound wins (`choose_interval`), so the snapshots
    # are 20 steps apart whatever the figures. The report and the start log said "every 20-10 steps".
    settings = SafetyArguments(nan_snapshot_steps=20)
    saves = config(save_strategy="steps", save_steps=10)
    summary = describe(settings, saves)
    assert "20-10" not in summary and "every 20 steps" in summary, summary
    interval = SnapshotInterval(settings)
    started = interval.start(saves, None, say=False)
    assert "20 to 10" not in started and interval.steps == 20, started


# --------------------------------------------------------------------------------------------------------------------
# A save a later callback asks for
# --------------------------------------------------------------------------------------------------------------------


class SaveAtFive(TrainerCallback):
    """A user callback (after the guard's) that asks for a save at step 5."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            control.should_save = True


def test_a_save_a_later_callback_asks_for_is_a_snapshot(toy_models, tmp_path):
    # "Snapshots are still taken at every save, evaluation and reference-model sync, whatever the interval": the state
    # of step 5 is verified before the save a later callback asked for and published as checkpoint-5, but no snapshot
    # was taken of it, so a fault at step 9 rolled back to step 0 (the interval's), behind the checkpoint.
    trainer = build_trainer(
        "sft", toy_models["qwen2"], tmp_path / "out", preset="guarded", faults=[Fault(step=9, kind="weight")],
        max_steps=12, save_steps=100, nan_snapshot_steps=10, nan_snapshot_budget=0.0,
    )  # fmt: skip
    trainer.add_callback(SaveAtFive())
    trainer.train()
    assert (tmp_path / "out" / "checkpoint-5").is_dir()
    assert 5 in trainer.nan_guard.interval.taken_at, trainer.nan_guard.interval.taken_at
    [rollback] = [e for e in read_events(trainer.args.output_dir) if e["kind"] == "rollback"]
    assert rollback["restored_step"] == 5


# --------------------------------------------------------------------------------------------------------------------
# Two rollbacks to the same snapshot
# --------------------------------------------------------------------------------------------------------------------


def test_two_rollbacks_to_one_snapshot_count_each_discarded_step_once(toy_models, tmp_path):
    # `global_step` never rewinds and a rollback takes no snapshot, so a second fault right after a rollback restores
    # the same snapshot again: its `discarded_steps` lists the first rollback's steps again (5-7, then 5-8), and the
    # `nan_guard/discarded_steps` counter added both (7), where 4 updates were thrown away (goodput, which takes the
    # set of the events' steps, counts 4).
    trainer = build_trainer(
        "sft", toy_models["qwen2"], tmp_path / "out", preset="guarded", faults=[Fault(step=7, kind="weight", repeat=2)],
        save_steps=4, nan_snapshot_steps=4, nan_snapshot_budget=0.0,
    )  # fmt: skip
    trainer.train()
    rollbacks = [e for e in read_events(trainer.args.output_dir) if e["kind"] == "rollback"]
    assert [(e["step"], e["restored_step"]) for e in rollbacks] == [(7, 4), (8, 4)]
    discarded = {step for e in rollbacks for step in e["discarded_steps"]}
    assert trainer.nan_guard.state.discarded_steps == len(discarded) == 4


def test_a_fractional_save_steps_is_reported_as_the_bound_it_is():
    # `save_steps=0.25` saves every quarter of the run, and the run bounds the interval by it (`state.save_steps`,
    # resolved when training starts); the safety report's summary said "every >= 1 steps", no upper bound.
    summary = describe(SafetyArguments(), config(save_strategy="steps", save_steps=0.25))
    assert "every >= 1 steps" not in summary and "to `save_steps` (0.25 of the run)" in summary, summary
    # With `max_steps` set, the bound is known before training, as the Trainer will resolve it (ceil(0.25 x 42)).
    summary = describe(SafetyArguments(), config(save_strategy="steps", save_steps=0.25, max_steps=42))
    assert summary.endswith("every 1-11 steps"), summary


@pytest.mark.distributed
def test_two_ranks_record_the_interval_a_resumed_run_starts_with(tmp_path):
    # Under DDP, a run resumed from checkpoint-6 records its starting interval on both ranks alike (a local event, no
    # collective), and both still agree on every later choice and take their snapshots at the same steps: a fault on
    # rank 1 at step 10 rolls both back to the resumed checkpoint's snapshot.
    import os

    from test_guard_distributed import accelerate_ddp, check_in_sync, launch

    extra = ["--save_steps", "6", "--snapshot_budget", "0.01", "--snapshot_steps", "-1"]
    check_in_sync(launch(accelerate_ddp(), "dpo", [], tmp_path, "--max_steps", "12", *extra), 0, 0, tmp_path / "out")
    checkpoint = os.path.join(str(tmp_path / "out"), "run", "checkpoint-6")
    resumed = launch(accelerate_ddp(), "dpo", ["weight:10:1"], tmp_path, "--max_steps", "16", "--resume", checkpoint,
                     *extra)  # fmt: skip
    events = check_in_sync(resumed, 1, 1, tmp_path / "out")
    ranks = [r["intervals"] for r in resumed]
    assert ranks[0] == ranks[1] and ranks[0][0]["resumed"] and ranks[0][0]["interval"] == 6, ranks
    assert [e["restored_step"] for e in events if e["kind"] == "rollback"] == [6]
