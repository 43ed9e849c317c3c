"""A job's end time met without a signal (`restarts/deadline.py`): the run publishes a verified checkpoint and exits
with status 75 before `job_end_time` (or SLURM's `SLURM_JOB_END_TIME`), and a relaunch resumes from it."""

from __future__ import annotations

import json
import os
import time

import pytest
from guard_utils import nonfinite_in_checkpoints, recording
from test_crash_restarts import assert_uninterrupted_batches, launch_restarting, steps
from transformers import TrainerCallback

from safe_trainers.guard import read_events
from safe_trainers.restarts.deadline import (
    ASSUMED_WRITE_RATE, SLURM_END, Deadline, deadline_reached, job_end_time, margin_seconds,
)  # fmt: skip
from safe_trainers.restarts.preemption import PREEMPTED_EXIT_CODE, Preempted
from safe_trainers.testing.build import build_trainer
from safe_trainers.trainers import trainer_class


def test_the_end_time_comes_from_the_setting_else_from_slurm():
    assert job_end_time(None, {}) is None
    assert job_end_time(None, {SLURM_END: "1700000000"}) == (1700000000.0, f"`{SLURM_END}`")
    assert job_end_time(1800000000.0, {SLURM_END: "1700000000"}) == (1800000000.0, "`job_end_time`")
    assert job_end_time(0, {SLURM_END: "1700000000"}) is None  # `0`: no deadline, whatever the scheduler says
    assert job_end_time(None, {SLURM_END: " "}) is None
    with pytest.raises(ValueError, match=r"`SLURM_JOB_END_TIME` is 'soon'.*`job_end_time=0`"):
        job_end_time(None, {SLURM_END: "soon"})


def test_the_margin_holds_the_steps_until_every_rank_stops_the_save_and_the_slack():
    assert margin_seconds(2.0, 30.0, 60.0, stop_lag=0) == 92.0  # one more step, the save, the slack
    assert margin_seconds(2.0, 30.0, 60.0, stop_lag=2) == 96.0  # under several ranks two more steps to agree
    assert deadline_reached(now=1000.0, end=1092.0, margin=92.0)
    assert not deadline_reached(now=999.0, end=1092.0, margin=92.0)


def test_the_deadline_learns_the_longest_step_and_save():
    now = [1000.0]
    deadline = Deadline(2000.0, "`job_end_time`", 10.0, lambda: int(ASSUMED_WRITE_RATE * 5), clock=lambda: now[0])
    deadline.train_began(stop_lag=0)
    assert deadline.margin() == 15.0  # no step yet; the save assumed at 5 s
    for took in (3.0, 7.0, 4.0):
        deadline.step_began()
        now[0] += took
        assert not deadline.step_ended()
    deadline.save_began(3)  # this step saves: published 20 s after its end
    now[0] += 20.0
    deadline.saved(3)
    assert (deadline.longest_step, deadline.save_seconds, deadline.margin()) == (7.0, 20.0, 37.0)
    now[0] = 2000.0 - 37.0
    deadline.step_began()
    assert deadline.step_ended()  # a step of 0 s, but the next one might take 7 s: stop now


def test_saves_in_flight_are_timed_each_from_its_own_start_and_count_in_the_margin():
    # Background saves: checkpoint-2's write outlasts the save interval; checkpoint-4 begins before it is published.
    now = [0.0]
    deadline = Deadline(1e6, "`job_end_time`", 10.0, lambda: 0, clock=lambda: now[0])
    deadline.train_began(stop_lag=0)
    deadline.save_began(2)
    now[0] = 100.0
    deadline.save_began(4)
    now[0] = 130.0
    deadline.saved(2)  # 130 s, not 30 s from checkpoint-4's start
    assert deadline.save_seconds == 130.0
    # checkpoint-4 still in flight, 30 s in: a stop now waits for its 100 s left, then writes its own 130 s.
    assert deadline.margin() == 0.0 + 130.0 + 10.0 + 100.0
    now[0] = 300.0
    deadline.saved(4)
    assert (deadline.save_seconds, deadline.margin()) == (200.0, 210.0)


class Sleep(TrainerCallback):
    """Each step takes at least `seconds`: a run that cannot finish before the deadline."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def test_a_run_that_cannot_finish_publishes_a_checkpoint_and_exits_75_before_the_end(toy_models, tmp_path):
    out = str(tmp_path / "out")
    cls = recording(trainer_class("dpo"))
    end = time.time() + 10.0
    first = build_trainer(
        "dpo", toy_models["qwen2"], out, preset="guarded", trainer_cls=cls, max_steps=200, job_end_time=end,
        job_end_slack=2.0,
    )  # fmt: skip
    first.add_callback(Sleep(0.2))
    with pytest.raises(Preempted) as caught:
        first.train()
    exited = time.time()
    step = caught.value.step
    assert caught.value.code == PREEMPTED_EXIT_CODE and caught.value.signal == "deadline"
    assert exited < end and 0 < step < 200  # done before the job's end, long before the last step
    assert f"checkpoint-{step}" in os.listdir(out) and not nonfinite_in_checkpoints(out)
    with open(os.path.join(out, f"checkpoint-{step}", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == step
    event = [e for e in read_events(out) if e["kind"] == "preempt"][-1]
    assert (event["step"], event["signal"], event["job_end"]) == (step, "deadline", end)
    assert 0 < event["seconds_left"] and event["margin"] >= 2.0

    # The relaunch (no deadline now) goes on from the published step with the batches an uninterrupted run trains
    # (every run is built for 200 steps, so that their data order and schedule match; the last two stop early).
    resumed = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", trainer_cls=cls, max_steps=200)
    resumed.add_callback(StopAt(step + 3))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == step + 3
    reference = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path / "ref"), preset="guarded", trainer_cls=cls, max_steps=200
    )
    reference.add_callback(StopAt(step + 3))
    reference.train()
    assert first.seen + resumed.seen == reference.seen  # no step lost, none repeated


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = control.should_training_stop or state.global_step >= self.step


def test_slurm_end_time_is_read_and_job_end_time_0_turns_it_off(toy_models, tmp_path, monkeypatch):
    monkeypatch.setenv(SLURM_END, str(int(time.time()) - 5))  # already past: stop after the first step
    out = str(tmp_path / "out")
    trainer = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=6)
    with pytest.raises(Preempted) as caught:
        trainer.train()
    assert (caught.value.step, caught.value.signal) == (1, "deadline")
    assert "checkpoint-1" in os.listdir(out) and not nonfinite_in_checkpoints(out)

    off = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path / "off"), preset="guarded", max_steps=3, job_end_time=0
    )
    off.train()  # the scheduler's end is ignored
    assert off.state.global_step == 3 and off.safe_run.preemption.deadline is None


def test_a_deadline_during_the_last_step_finishes_the_run(toy_models, tmp_path):
    # Reached at the last step, the run is over anyway: it saves nothing extra and does not exit 75.
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path / "out"), preset="guarded", max_steps=1, job_end_time=time.time() - 1
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert not [e for e in read_events(trainer.args.output_dir) if e["kind"] == "preempt"]


@pytest.mark.distributed
def test_two_ranks_past_their_deadline_stop_at_the_same_step_and_the_restart_goes_on(tmp_path):
    # Attempt 0 starts past its deadline: each rank asks to stop at the end of step 1; the request rides on step 2's
    # all-reduce and is read back at the end of step 3, where both ranks publish checkpoint-3 and exit 75; torchrun
    # restarts them (attempt 1, no deadline) and they go on at step 4 with the batches of an uninterrupted run.
    results, streams = launch_restarting(tmp_path, 2, 1, "--job_ended", "0", "--max_steps", "6", "--save_steps", "100")
    for result, stream in zip(results, streams):
        assert_uninterrupted_batches(result, stream)
        assert steps(stream, "fed") == {0: [1, 2, 3], 1: [4, 5, 6]}
        assert (result["attempt"], result["global_step"], result["finite"]) == (1, 6, True)
    run = str(tmp_path / "out" / "run")
    events = read_events(run)
    assert [(e["step"], e["kind"]) for e in events] == [(3, "preempt"), (3, "resume")]
    assert events[0]["signal"] == "deadline" and events[0]["ranks"] == [0, 1]
    assert events[1]["checkpoint"] == os.path.join(run, "checkpoint-3") and not nonfinite_in_checkpoints(run)
