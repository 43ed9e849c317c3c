"""Crashes and restarts: a process killed by a signal continues from its newest healthy checkpoint, a step whose
batches kill it twice in a row is skipped, and `resume_from_checkpoint=True` passes over NaN and half-written
checkpoints.

The restart tests run under torchrun's elastic agent (`--max-restarts`) with tests/workers/restart_worker.py, which
SIGKILLs itself when it feeds the model a micro-batch of a chosen step, in chosen attempts.
"""

from __future__ import annotations

import json
from dataclasses import replace
import os
import subprocess
import sys

import pytest
from guard_utils import nonfinite_in_checkpoints, recording
from net_utils import EXIT_RACE
from timeline_utils import drawn_timeline
from safetensors.torch import load_file, save_file

from safe_trainers.cli.main import main
from safe_trainers.guard import read_events
from safe_trainers.replay import bundle_steps, read_bundle
from safe_trainers.restarts.progress import (
    Death, History, Poisoned, Progress, ProgressWriter, inherit, poison, read_progress,
)  # fmt: skip
from safe_trainers.restarts.resume_plan import NOT_THIS_LAUNCHS, plan_resume, this_launchs
from safe_trainers.restarts.checkpoint_choice import CheckpointChoice
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.toy import save_toy_model
from safe_trainers.trainers import trainer_class


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "workers", "restart_worker.py")


# ---------------------------------------------------------------------------------------------------- pure decisions
@pytest.mark.parametrize(
    "deaths,times,expected",
    [
        ([(0, 7), (1, 7)], 2, Poisoned(7, (0, 1))),
        ([(0, 6), (1, 7)], 2, None),  # a crash on different data each time is never skipped
        ([(0, 7), (1, None), (2, 7)], 2, None),  # a death between steps (a save, a log) breaks the streak
        ([(0, 7)], 2, None),
        ([(0, 7), (1, 7)], 3, None),
        ([(0, 7), (1, 7)], 0, None),  # `skip_step_after_crashes=0`: never
        ([(0, 5), (1, 7), (2, 7), (3, 7)], 3, Poisoned(7, (1, 2, 3))),
    ],
)
def test_poison_is_the_same_step_dying_times_in_a_row(deaths, times, expected):
    assert poison(tuple(Death(a, s) for a, s in deaths), times) == expected


def test_a_new_process_inherits_the_record_of_the_one_that_died(tmp_path):
    data = "world=1 batch=2"
    writer = ProgressWriter(str(tmp_path), History(1, deaths=(Death(0, 7),)), data)
    for step, phase in [(10000, "step"), (10000, "between"), (7, "step")]:  # a shorter record over a longer one
        writer.write(step, phase)
    writer.close()
    died = read_progress(str(tmp_path))
    assert died == Progress(7, "step", data, History(1, deaths=(Death(0, 7),)))
    history = inherit(died, continuing=True, data=data, skip_after=2)
    assert history.attempt == 2 and history.deaths == (Death(0, 7), Death(1, 7))
    assert history.poisoned_step(7) == Poisoned(7, (0, 1))
    assert inherit(died, continuing=False, data=data, skip_after=2).deaths == ()  # a new run: a new history
    assert inherit(died, continuing=True, data="world=2 batch=2", skip_after=2).deaths == ()  # other batches
    finished = Progress(10, "finished", data, History(3, deaths=(Death(0, 7),), poisoned=(Poisoned(7, (0, 1)),)))
    after = inherit(finished, continuing=True, data=data, skip_after=2)
    assert after.deaths == (Death(0, 7),) and after.poisoned_step(7)  # no death added; step 7 stays skipped


def written(record: Progress, **history) -> Progress:
    """`record` with some fields of its history changed."""
    return replace(record, history=replace(record.history, **history))


def test_plan_resume_from_the_launchers_restart_count():
    chosen = CheckpointChoice("out/checkpoint-4")
    agents = ("none@host:/tmp/torchelastic_a/none_b",)
    ours = Progress(6, "step", "", History(1, launch=agents, restart=1, checkpoints=(4,)))

    def plan(requested, env, record=ours, **kwargs):
        return plan_resume(
            requested, env, "out", launch=agents, choose=lambda *_: chosen, previous=lambda _: record, **kwargs
        )  # fmt: skip

    restarted = {"TORCHELASTIC_RESTART_COUNT": "2"}
    assert (plan(None, restarted).checkpoint, plan(None, restarted).reason) == ("out/checkpoint-4", "restart")
    assert plan(None, restarted).history.attempt == 2 and plan(None, restarted).history.checkpoints == (4,)
    assert plan(None, restarted).history.restart == 2 and not plan(None, restarted).finished
    # A restart trusts only its own launch's record for the same `train()` call: none (the launch died before
    # training), another launch's (another agent), one not written by an earlier attempt, or one of an earlier
    # `train()` call of the script, means this call trained nothing yet: it starts over, with a history of its own.
    others = [None, written(ours, launch=("none@host:/tmp/torchelastic_c/none_d",)), written(ours, restart=2)]
    for record, stage in [(r, 1) for r in others] + [(ours, 2)]:
        fresh = plan(None, restarted, record=record, stage=stage)
        assert (fresh.checkpoint, fresh.history.deaths, fresh.history.launch) == (None, (), agents)
        assert (fresh.history.stage, fresh.history.checkpoints) == (stage, ())
    # A later `train()` call of the launch wrote over this one's record in the same output_dir.
    with pytest.raises(ValueError, match=r"call #1 with `output_dir='out'` had finished .* call #2"):
        plan(None, restarted, record=written(ours, stage=2))
    assert plan(None, restarted, resume_on_restart=False).checkpoint is None
    assert plan(None, {"TORCHELASTIC_RESTART_COUNT": "0"}).reason == "new"
    assert plan(None, {}).checkpoint is None
    # A path passed to `train()` starts the launch; a restart of it goes on from the launch's newest checkpoint, or
    # from the path again when the launch has none yet (or the record is another launch's).
    assert plan("out/checkpoint-2", restarted).checkpoint == "out/checkpoint-4"
    assert plan("out/checkpoint-2", restarted, record=None).checkpoint == "out/checkpoint-2"
    assert plan("out/checkpoint-2", {}).checkpoint == "out/checkpoint-2"
    assert plan(True, {}).reason == "requested"
    # A call that finished: its restart returns what it returned (`history.result`), from its final checkpoint.
    result = {"global_step": 8, "training_loss": 0.5, "metrics": {"train_loss": 0.5}}
    done = plan(None, restarted, record=written(replace(ours, step=8, phase="finished"), result=result))
    assert (done.finished, done.history.result, done.checkpoint) == (True, result, "out/checkpoint-4")


def test_a_restart_trusts_only_the_checkpoints_its_launch_published():
    ours = Progress(6, "step", "", History(1, launch=("a",), restart=0, origin="out/checkpoint-2", checkpoints=(4, 8)))
    problem = this_launchs(ours)
    assert problem("out/checkpoint-12") == NOT_THIS_LAUNCHS  # an earlier run's, whatever its file times say
    assert problem("out/checkpoint-6") == NOT_THIS_LAUNCHS
    assert problem("out/checkpoint-4").startswith("incomplete: no `trainer_state.json`")  # its own: checked as usual
    assert problem("out/checkpoint-2").startswith("incomplete")  # the one the launch began from


# ---------------------------------------------------------------------------------------------------- healthy resume
def test_resume_true_passes_over_nan_and_half_written_checkpoints(toy_models, tmp_path):
    out = str(tmp_path / "out")
    first = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded",
                          trainer_cls=recording(trainer_class("dpo")), max_steps=8, save_steps=2)
    first.train()
    weights = os.path.join(out, "checkpoint-8", "model.safetensors")  # as another tool could have saved it
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    os.remove(os.path.join(out, "checkpoint-6", "trainer_state.json"))  # a save killed half-way

    resumed = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded",
                            trainer_cls=recording(trainer_class("dpo")), max_steps=8, save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.seen == first.seen[4:]  # from checkpoint-4: steps 5-8, the same batches
    event = [e for e in read_events(out) if e["kind"] == "resume"][-1]
    assert (event["step"], event["reason"], event["checkpoint"]) == (4, "requested", os.path.join(out, "checkpoint-4"))
    passed = [(os.path.basename(p["checkpoint"]), p["reason"]) for p in event["passed_over"]]
    assert passed[0] == ("checkpoint-8", f"non-finite: `{name}` in `model.safetensors`")
    assert passed[1][0] == "checkpoint-6" and passed[1][1].startswith("incomplete: no `trainer_state.json`")

    for step in (2, 4, 6, 8):
        os.remove(os.path.join(out, f"checkpoint-{step}", "trainer_state.json"))
    again = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=8, save_steps=2)
    with pytest.raises(ValueError, match=r"found no checkpoint to resume from.*`checkpoint-2`: incomplete"):
        again.train(resume_from_checkpoint=True)


# ---------------------------------------------------------------------------------------------------- restarts
def launch_restarting(
    tmp_path, processes: int, restarts: int, *args: str, rendezvous=("--standalone",), wrapper: bool = False
) -> tuple[list[dict], list[list[dict]]]:
    """Run the worker under torchrun with `restarts` restarts; return each rank's result and micro-batch stream.

    `rendezvous`: torchrun's rendezvous options; `wrapper`: start it as a cluster job does, through a shell script that
    sets the environment and then runs python (`torchrun --no-python train.sh`: a new shell at each restart)."""
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out = tmp_path / "out"
    program = [WORKER]
    if wrapper:
        script = tmp_path / "train.sh"
        script.write_text(f'#!/bin/sh\nexport OMP_NUM_THREADS=1\n"{sys.executable}" "{WORKER}" "$@"\n')
        script.chmod(0o755)
        program = ["--no-python", str(script)]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node", str(processes),
        "--max-restarts", str(restarts), *program, "--model", model, "--out", str(out), *args,
    ]  # fmt: skip
    # Restarting a multi-rank group: the workers' process group must not reuse the agent's rendezvous store, whose
    # keys still name the dead workers' ports (pytorch#135712); see docs/launching.md.
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    finished = all((out / f"result-rank{rank}.json").exists() for rank in range(processes))
    exit_race = done.returncode != 0 and EXIT_RACE in done.stderr and finished  # see test_guard_distributed.py
    assert done.returncode == 0 or exit_race, (done.stdout + done.stderr)[-4000:]
    results = [json.loads((out / f"result-rank{rank}.json").read_text()) for rank in range(processes)]
    streams = [
        [json.loads(line) for line in (out / f"stream-rank{rank}.jsonl").read_text().splitlines()]
        for rank in range(processes)
    ]
    return results, streams


def steps(stream: list[dict], event: str) -> dict[int, list[int]]:
    """The steps of the micro-batches each attempt was handed (`delivered`) or fed to the model (`fed`)."""
    out: dict[int, list[int]] = {}
    for line in stream:
        if line["event"] == event:
            out.setdefault(line["attempt"], []).append(line["step"])
    return out


def assert_uninterrupted_batches(result: dict, stream: list[dict]) -> None:
    """Every micro-batch any attempt was handed is the one an uninterrupted run trains at that step."""
    expected = result["expected"]
    assert [line["hash"] for line in stream] == [expected[line["step"] - 1] for line in stream]


@pytest.mark.distributed
def test_restart_continues_from_the_checkpoint_and_skips_a_poison_step(tmp_path, capsys):
    # Checkpoints every 4 steps; a NaN weight at step 3 (a skip and a rollback, LR x0.5) before checkpoint-4.
    # Attempt 0 dies feeding step 6; attempts 1 and 2 die feeding step 7 (a crash on other data than attempt 0's:
    # attempt 2 feeds step 7 again); attempt 3 skips step 7's batches and ends at step 10.
    (result,), (stream,) = launch_restarting(
        tmp_path, 1, 3, "--kill", "6:0", "--kill", "7:1-", "--fault", "weight:3", "--max_steps", "10"
    )
    assert_uninterrupted_batches(result, stream)
    assert steps(stream, "fed") == {0: [1, 2, 3, 4, 5, 6], 1: [5, 6, 7], 2: [5, 6, 7], 3: [5, 6, 8, 9, 10]}
    assert steps(stream, "delivered")[3] == [5, 6, 7, 8, 9, 10]  # step 7's batch is taken, not trained
    assert (result["attempt"], result["global_step"], result["finite"]) == (3, 10, True)
    # The guard's state came back from checkpoint-4 at each restart: step 3's skip, its rollback and LR backoff.
    assert (result["skipped"], result["rollbacks"], result["lr_scale"]) == (2, 1, 0.5)
    run = str(tmp_path / "out" / "run")
    events = read_events(run)
    assert [(e["step"], e["kind"]) for e in events] == [
        (3, "skip"), (3, "rollback"), (4, "resume"), (4, "resume"), (4, "resume"), (7, "poison"), (7, "skip"),
    ]  # fmt: skip
    resumes = [e for e in events if e["kind"] == "resume"]
    assert {e["checkpoint"] for e in resumes} == {os.path.join(run, "checkpoint-4")}
    assert [(e["restart"], e["reason"]) for e in resumes] == [(1, "restart"), (2, "restart"), (3, "restart")]
    assert resumes[-1]["deaths"] == [{"attempt": 0, "step": 6}, {"attempt": 1, "step": 7}, {"attempt": 2, "step": 7}]
    assert (events[5]["attempts"], events[5]["micro_batches"], events[5]["skipped"]) == ([1, 2], [6, 6], True)
    assert not nonfinite_in_checkpoints(run)
    # The poisoned step's batches, as the dataloader gave them, are kept in a replay bundle (docs/replay.md); the
    # loop never replays them (they killed the process), `safe-trainers replay` does, on the CPU.
    assert bundle_steps(run) == [3, 7]
    meta, _, payload = read_bundle(run, 7)
    assert (meta["events"], meta["prepared"], meta["in_loop_diagnosis"]) == (["skip", "poison"], False, None)
    assert sorted(payload["micro_batches"]) == [0] and meta["checkpoint"] == "checkpoint-4"
    assert main(["replay", run, "--step", "7"]) == 0
    replayed = capsys.readouterr().out
    assert "from checkpoint-4" in replayed and "replay:  first non-finite module: no module output went" in replayed
    # Its timeline: a marker per event, four processes; steps 5, 5-6 and 5-6 of the three that died were redone.
    text, markers = drawn_timeline(run, str(tmp_path))
    assert markers == {("skip", 3), ("rollback", 3), ("restart", 4), ("poison", 7), ("skip", 7)}
    assert "in 4 process(es)" in text and "5 step(s) redone after a restart" in text, text


@pytest.mark.distributed
def test_restart_on_two_ranks_skips_the_batches_that_kill_one_rank(tmp_path):
    # DDP, 2 ranks: rank 1 dies feeding step 6, in every attempt. Attempt 1 resumes from checkpoint-4 and dies again;
    # attempt 2 skips step 6 on both ranks and ends at step 8.
    results, streams = launch_restarting(tmp_path, 2, 2, "--kill", "6:0-:1", "--max_steps", "8")
    assert results[0]["expected"] != results[1]["expected"]  # each rank reads its own shard
    for result, stream in zip(results, streams):
        assert_uninterrupted_batches(result, stream)
        assert steps(stream, "fed") == {0: [1, 2, 3, 4, 5, 6], 1: [5, 6], 2: [5, 7, 8]}
        assert (result["attempt"], result["global_step"], result["finite"], result["skipped"]) == (2, 8, True, 1)
    assert results[0]["checksum"] == results[1]["checksum"]
    events = read_events(str(tmp_path / "out" / "run"))
    assert [(e["step"], e["kind"]) for e in events] == [(4, "resume"), (4, "resume"), (6, "poison"), (6, "skip")]
    assert events[2]["attempts"] == [0, 1]


@pytest.mark.distributed
def test_a_restart_judges_its_first_steps_against_the_saved_spike_window(tmp_path):
    # Spike detection on (k=6, warm-up 4, lr 1e-5), a checkpoint every 10 steps. Each attempt sees a loss x100 at
    # step 11; attempt 0 dies feeding step 12. Attempt 1 resumes from checkpoint-10, whose window holds steps 1-10, and
    # skips step 11 at once: a window started afresh would still be warming up and let it through.
    args = ["--spike", "6:4", "--learning_rate", "1e-5", "--max_steps", "13", "--save_steps", "10"]
    (result,), _ = launch_restarting(tmp_path, 1, 1, "--kill", "12:0", "--fault", "loss_scale:11:100", *args)
    assert (result["attempt"], result["global_step"], result["spikes"]) == (1, 13, 1)
    events = read_events(str(tmp_path / "out" / "run"))
    assert [(e["step"], e["kind"]) for e in events] == [(10, "resume"), (11, "spike")]
    saved = json.loads((tmp_path / "out" / "run" / "checkpoint-10" / "nan_guard_state.json").read_text())
    assert len(saved["spike_window"]["loss"]) == 10
