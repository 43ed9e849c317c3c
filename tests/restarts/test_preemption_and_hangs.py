"""Preemption and hangs: a preemption signal costs no step, a hung step becomes a restart (issue 21, items 6-7).

The end-to-end cases run under torchrun's elastic agent with tests/workers/restart_worker.py, which sends itself a
SIGTERM (`--preempt`) or sleeps forever (`--hang`) when it feeds the model a micro-batch of a chosen step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from guard_utils import nonfinite_in_checkpoints, recording
from test_crash_restarts import REPO, WORKER, assert_uninterrupted_batches, launch_restarting, steps
from timeline_utils import drawn_timeline
from transformers import TrainerCallback

from safe_trainers.configs import config_class
from safe_trainers.errors import TrainingDivergedError
from safe_trainers.guard import read_events
from safe_trainers.restarts.preemption import PREEMPTED_EXIT_CODE, Preempted, parse_signals, stop_step
from safe_trainers.restarts.watchdog import HANG_FLOOR, HangWatchdog, hang_bound
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.testing.toy import save_toy_model
from safe_trainers.trainers import trainer_class


# ---------------------------------------------------------------------------------------------------- pure decisions
def test_signal_names_and_the_agreed_stop_step():
    assert parse_signals(["SIGTERM", "usr1", "TERM", str(int(signal.SIGUSR2))]) == (
        signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
    )  # fmt: skip
    assert parse_signals([]) == ()
    with pytest.raises(ValueError, match=r"`preempt_signals` contains 'SIGNOPE'"):
        parse_signals(["SIGNOPE"])
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        parse_signals(["KILL"])
    with pytest.raises(ValueError, match="`preempt_signals` contains 'SIGNOPE'"):
        config_class("dpo")(output_dir="unused", preempt_signals=["SIGNOPE"])
    with pytest.raises(ValueError, match="`hang_timeout` must be a number >= 0"):
        config_class("dpo")(output_dir="unused", hang_timeout=-1)
    # Every rank reads the same agreed bits, so every rank stops at the same step: `lag` after the first set bit.
    assert stop_step([(4, False), (5, True), (6, True)], lag=1) == 6
    assert stop_step([(4, False)], lag=1) is None
    assert stop_step([(5, True)], lag=0) == 5


def test_the_hang_bound_is_learned_from_the_steps_and_capped():
    assert hang_bound(None, 0, ceiling=900, factor=10) == 900  # nothing timed yet: the ceiling
    assert hang_bound(1.0, 1, ceiling=900, factor=10) == 900  # not enough steps timed
    assert hang_bound(1.0, 5, ceiling=900, factor=10) == HANG_FLOOR  # one-second steps: 120 s (< 5 minutes)
    assert hang_bound(30.0, 5, ceiling=900, factor=10) == 300
    assert hang_bound(200.0, 5, ceiling=900, factor=10) == 900
    assert hang_bound(1.0, 5, ceiling=15, factor=10) == 15


def test_the_watchdog_learns_from_steps_after_the_first_and_not_from_paused_time(tmp_path):
    clock = iter([0.0, 50.0, 100.0, 101.0, 200.0, 201.0, 212.0, 213.0])
    dog = HangWatchdog(str(tmp_path), rank=0, ceiling=900, factor=10, clock=lambda: next(clock))

    dog.step_began(1)  # 0.0
    dog.step_ended()  # 50.0: the first step (warm-up), not learned
    dog.step_began(2)  # 100.0
    dog.step_ended()  # 101.0: 1 s
    dog.step_began(3)  # 200.0
    with dog.paused():  # 201.0 -> 212.0: a snapshot's copy, not timed
        pass
    dog.step_ended()  # 213.0
    assert (dog.timed, dog.slowest) == (2, 2.0)  # 1 s and 213 - 200 - 11 = 2 s
    assert dog.bound() == HANG_FLOOR


def test_grpo_learns_its_hang_bound_from_a_step_that_generates(toy_models, tmp_path):
    # With `num_iterations=4` GRPO generates at steps 1, 5, 9...: steps 2-4 only train on the buffered rollouts and
    # are far faster. A bound learned from them alone (120 s) killed step 5's legitimate 130 s generation (or reward
    # call) with status 124, though `hang_timeout` was 900. The bound is learned once a generating step was timed.
    trainer = build_trainer("grpo", toy_models["qwen2"], tmp_path, preset="guarded", num_iterations=4, bf16=False)
    dog = trainer.safe_run.watchdog
    clock = iter([0.0, 60.0, 100.0, 101.0, 200.0, 201.0, 300.0, 301.0, 400.0, 530.0])
    dog.clock = lambda: next(clock)

    for step in range(1, 5):  # step 1 generates (the warm-up step), steps 2-4 reuse its rollouts: 1 s each
        dog.step_began(step)
        dog.step_ended()
    assert dog.bound() == 900  # step 5 generates again: not yet taken for hung after 120 s
    dog.step_began(5)
    dog.step_ended()  # 130 s, timed
    assert dog.bound() == 900  # learned from a generating step: 10 x 130 s, capped
    plain = build_trainer("grpo", toy_models["qwen2"], tmp_path / "plain", preset="guarded", bf16=False)
    assert plain.safe_run.watchdog.learn_after == 2  # generating at every step: the usual two steps


def test_the_abort_checkpoint_is_not_timed_as_part_of_the_step(toy_models, tmp_path):
    # An abort saves the last good state as a checkpoint from inside the step's inspection. Timed with the step, a
    # save longer than the learned bound (120 s: a large model on shared storage) ended the process with status 124
    # half-way through the abort checkpoint, and the agent restarted a run that had diverged.
    class Recording(trainer_class("sft")):
        timed_saves: list = []

        def _save_checkpoint(self, model, trial):
            self.timed_saves.append((self.state.global_step, self.safe_run.watchdog._began is not None))
            return super()._save_checkpoint(model, trial)

    fault = Fault(step=3, kind="loss", repeat=1000)
    trainer = build_trainer(
        "sft", toy_models["qwen2"], tmp_path, preset="guarded", faults=[fault], nan_max_rollbacks=0, max_steps=8,
        save_strategy="no", bf16=False, trainer_cls=Recording,
    )  # fmt: skip
    with pytest.raises(TrainingDivergedError):
        trainer.train()
    assert trainer.timed_saves and not any(timed for _, timed in trainer.timed_saves), trainer.timed_saves


def test_jit_checkpoint_is_refused_under_the_guard_with_what_to_use_instead(toy_models, tmp_path):
    # transformers' JIT checkpoint saves mid-step on each rank after its own timer: the guard's verified, collective
    # save cannot run like that. It is refused before transformers installs its SIGTERM handler.
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match=r"`enable_jit_checkpoint=True`.*`preempt_signals`.*status 75"):
        build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", enable_jit_checkpoint=True)
    assert signal.getsignal(signal.SIGTERM) is before
    stock = build_trainer("dpo", toy_models["qwen2"], tmp_path, nan_guard=False, enable_jit_checkpoint=True)
    assert stock.nan_guard is None  # without the guard, transformers' own mechanism is left as it is
    signal.signal(signal.SIGTERM, before)  # its handler, installed by that construction


# ---------------------------------------------------------------------------------------------------- in process
class _SignalAt(TrainerCallback):
    """Sends the process a signal in the middle of a step (at its optimizer step) and records the handlers."""

    def __init__(self, step: int, sig: signal.Signals, times: int = 1):
        self.step, self.sig, self.times, self.handlers = step, sig, times, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.handlers.append(signal.getsignal(self.sig))
        if state.global_step + 1 == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.sig)


def test_a_signal_publishes_the_step_and_the_resume_goes_on_with_the_same_batches(toy_models, tmp_path):
    out = str(tmp_path / "out")
    chained = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: chained.append(signum))
    try:
        cls = recording(trainer_class("dpo"))
        first = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", trainer_cls=cls, max_steps=8)
        sender = _SignalAt(3, signal.SIGUSR1)
        first.add_callback(sender)
        with pytest.raises(Preempted) as caught:
            first.train()
        assert (caught.value.code, caught.value.step, caught.value.signal) == (PREEMPTED_EXIT_CODE, 3, "SIGUSR1")
        assert chained == [signal.SIGUSR1]  # the handler installed before `train()` was still called
        assert signal.getsignal(signal.SIGUSR1) is not sender.handlers[0]  # ours while training, then put back
        assert signal.getsignal(signal.SIGUSR1) is not None and callable(signal.getsignal(signal.SIGUSR1))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert sorted(os.listdir(out)).count("checkpoint-3") == 1 and not nonfinite_in_checkpoints(out)
    with open(os.path.join(out, "checkpoint-3", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 3
    event = [e for e in read_events(out) if e["kind"] == "preempt"][-1]
    assert (event["step"], event["signal"], event["ranks"], event["received_step"]) == (3, "SIGUSR1", [0], 3)

    resumed = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", trainer_cls=cls, max_steps=8)
    resumed.train(resume_from_checkpoint=True)
    reference = build_trainer("dpo", toy_models["qwen2"], str(tmp_path / "ref"), preset="guarded", trainer_cls=cls,
                              max_steps=8)  # fmt: skip
    reference.train()
    assert first.seen + resumed.seen == reference.seen  # steps 1-3, then 4-8: no step lost, none repeated


def test_a_repeated_signal_is_the_same_request(toy_models, tmp_path):
    # Under SLURM with torchrun a worker gets the job's SIGTERM and the agent's forwarded copy at once.
    out = str(tmp_path / "out")
    trainer = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=6)
    trainer.add_callback(_SignalAt(3, signal.SIGTERM, times=2))
    with pytest.raises(Preempted) as caught:
        trainer.train()
    assert (caught.value.code, caught.value.step) == (PREEMPTED_EXIT_CODE, 3)
    assert "checkpoint-3" in os.listdir(out) and not nonfinite_in_checkpoints(out)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


def test_handlers_are_left_alone_without_the_guard_or_with_no_signals(toy_models, tmp_path):
    for config in ({"nan_guard": False}, {"preempt_signals": []}):
        trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=2, **config)
        watcher = _SignalAt(99, signal.SIGTERM)
        trainer.add_callback(watcher)
        trainer.train()
        assert watcher.handlers == [signal.SIG_DFL] * 2 and trainer.safe_run.preemption is None


# ---------------------------------------------------------------------------------------------------- under torchrun
@pytest.mark.distributed
def test_sigterm_on_one_process_publishes_that_step_and_the_restart_goes_on(tmp_path):
    (result,), (stream,) = launch_restarting(tmp_path, 1, 1, "--preempt", "5:0", "--max_steps", "8")
    assert_uninterrupted_batches(result, stream)
    assert steps(stream, "fed") == {0: [1, 2, 3, 4, 5], 1: [6, 7, 8]}  # step 5 finished, none lost or repeated
    assert (result["attempt"], result["global_step"], result["finite"]) == (1, 8, True)
    run = str(tmp_path / "out" / "run")
    events = read_events(run)
    assert [(e["step"], e["kind"]) for e in events] == [(5, "preempt"), (5, "resume")]
    assert events[1]["checkpoint"] == os.path.join(run, "checkpoint-5") and not nonfinite_in_checkpoints(run)
    text, markers = drawn_timeline(run, str(tmp_path))  # its timeline: two processes, nothing redone
    assert markers == {("preempt", 5), ("restart", 5)}
    assert "in 2 process(es)" in text and "redone" not in text and "state: finished at step 8" in text, text


@pytest.mark.distributed
def test_sigterm_on_one_rank_of_two_stops_both_at_the_same_step(tmp_path):
    # Rank 1 alone gets SIGTERM while feeding step 5. The bit rides on the guard's all-reduce of step 5 and is read
    # back at the end of step 6 (no host synchronisation): both ranks publish checkpoint-6 and the restart goes on
    # at step 7 with the batches of an uninterrupted run.
    results, streams = launch_restarting(tmp_path, 2, 1, "--preempt", "5:0:1", "--max_steps", "8")
    for result, stream in zip(results, streams):
        assert_uninterrupted_batches(result, stream)
        assert steps(stream, "fed") == {0: [1, 2, 3, 4, 5, 6], 1: [7, 8]}
        assert (result["attempt"], result["global_step"], result["finite"]) == (1, 8, True)
    assert results[0]["checksum"] == results[1]["checksum"]
    run = str(tmp_path / "out" / "run")
    events = read_events(run)
    assert [(e["step"], e["kind"]) for e in events] == [(6, "preempt"), (6, "resume")]
    assert events[0]["ranks"] == [1] and events[1]["checkpoint"] == os.path.join(run, "checkpoint-6")
    text, markers = drawn_timeline(run, str(tmp_path))  # drawn from rank 0's files
    assert markers == {("preempt", 6), ("restart", 6)} and "in 2 process(es)" in text, text


@pytest.mark.distributed
def test_a_rank_that_hangs_is_detected_and_a_step_that_hangs_twice_is_skipped(tmp_path):
    # Rank 1 sleeps forever feeding step 6 in attempts 0 and 1; rank 0 waits for it in the step's all-reduce. Both
    # pass the bound (`hang_timeout=10`), write their stacks and exit; the agent restarts them from checkpoint-4.
    # The second hang at step 6 counts like a second crash there: attempt 2 skips step 6's batches.
    results, streams = launch_restarting(
        tmp_path, 2, 2, "--hang", "6:0,1:1", "--hang_timeout", "10", "--max_steps", "8"
    )
    for result, stream in zip(results, streams):
        assert_uninterrupted_batches(result, stream)
        assert steps(stream, "fed")[2] == [5, 7, 8]
        assert (result["attempt"], result["global_step"], result["finite"], result["skipped"]) == (2, 8, True, 1)
    run = tmp_path / "out" / "run"
    stacks = (run / "hang-stacks-rank1.txt").read_text()
    assert [stacks.count(f"=== rank 1, attempt {a}: step 6 has run") for a in (0, 1)] == [1, 1]
    assert "in compute_loss" in stacks  # where rank 1 was stuck
    # Rank 0, stuck in the all-reduce, writes its own when its watchdog passes the bound before gloo reports the
    # lost peer (both happen within the same second).
    if (run / "hang-stacks-rank0.txt").exists():
        assert "step 6 has run" in (run / "hang-stacks-rank0.txt").read_text()
    events = read_events(str(run))
    assert [(e["step"], e["kind"]) for e in events] == [(4, "resume"), (4, "resume"), (6, "poison"), (6, "skip")]
    assert events[1]["deaths"] == [{"attempt": 0, "step": 6}, {"attempt": 1, "step": 6}]


@pytest.mark.distributed
def test_sigterm_to_the_agent_reaches_every_rank_and_a_new_job_resumes(tmp_path):
    # As SLURM or Kubernetes stop a job: SIGTERM to torchrun, which forwards it to both workers. They publish the
    # checkpoint of one agreed step; the agent, told to stop, exits without restarting. The re-submitted job
    # (`resume_from_checkpoint=True`) goes on at the next step with the batches of an uninterrupted run.
    model, out = save_toy_model(str(tmp_path / "model"), "qwen2"), tmp_path / "out"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", WORKER,
        "--model", model, "--out", str(out), "--max_steps", "40", "--save_steps", "100",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agent = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stream = out / "stream-rank0.jsonl"
    deadline = time.monotonic() + 300
    while not (stream.exists() and stream.read_text().count('"step": 4, "event": "fed"')):
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[0][-3000:]
        time.sleep(0.2)
    agent.send_signal(signal.SIGTERM)
    log = agent.communicate(timeout=120)[0].decode()
    assert agent.returncode != 0 and "exiting with status 75 (preempted, resumable)" in log, log[-3000:]
    run = out / "run"
    published = [int(name.split("-")[1]) for name in os.listdir(run) if name.startswith("checkpoint-")]
    assert len(published) == 1 and published[0] >= 4, published
    stopped = published[0]
    event = [e for e in read_events(str(run)) if e["kind"] == "preempt"][0]
    assert event["step"] == stopped and event["ranks"] == [0, 1]

    again = subprocess.run([*cmd, "--resume"], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    for rank in (0, 1):
        lines = [json.loads(line) for line in (out / f"stream-rank{rank}.jsonl").read_text().splitlines()]
        result = json.loads((out / f"result-rank{rank}.json").read_text())
        assert_uninterrupted_batches(result, lines)
        fed = [line["step"] for line in lines if line["event"] == "fed"]
        assert fed == list(range(1, 41))  # steps 1 to `stopped`, then the new job's: none lost, none repeated
        assert result["global_step"] == 40
