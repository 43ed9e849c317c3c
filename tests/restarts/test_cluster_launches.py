"""Restarts as clusters run them (issue 21): a script restarted after its `train()` returned, wrapper scripts, a second
launch with the same rendezvous defaults, shared storage whose clock lags, rotation in a reused `output_dir` under
rollback from disk, and checkpoints written in place and cut short.

The end-to-end tests run tests/workers/restart_worker.py under torchrun's elastic agent (`--max-restarts`), as
test_crash_restarts.py does; the pure decisions (launch identity, rotation, file completeness) are tested first.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from guard_utils import checkpoint_steps, recording
from net_utils import free_port
from safetensors.torch import save_file
from test_crash_restarts import assert_uninterrupted_batches, launch_restarting

from safe_trainers.guard import read_events
from safe_trainers.restarts.completeness import incomplete_file
from safe_trainers.restarts.agents import agent_identity, agent_run_dir, find_agent, launch_agents, same_launch
from safe_trainers.restarts.rotation import rotation_victims
from safe_trainers.restarts.progress import read_progress
from safe_trainers.testing.build import build_trainer
from safe_trainers.trainers import trainer_class


# ---------------------------------------------------------------------------------------------------- pure decisions
def test_a_launch_is_named_by_what_its_elastic_agent_keeps_across_restarts():
    def env(attempt: int, run_dir: str = "/tmp/torchelastic_x1/none_y1", run_id: str = "none") -> dict[str, str]:
        error_file = f"{run_dir}/attempt_{attempt}/0/error.json"  # what the agent sets (torch's DefaultLogsSpecs)
        return {"TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_ERROR_FILE": error_file}

    assert agent_run_dir(env(3)) == "/tmp/torchelastic_x1/none_y1"
    assert agent_run_dir({"TORCHELASTIC_ERROR_FILE": "/somewhere/error.json"}) == ""  # not torchrun's layout
    # Every restart of one agent: the same name, whatever process runs the script (a wrapper shell, python itself).
    assert agent_identity(env(0), "node1") == agent_identity(env(2), "node1")
    # Another launch with the same rendezvous defaults (`TORCHELASTIC_RUN_ID=none`): another agent directory.
    assert agent_identity(env(0), "node1") != agent_identity(env(0, "/tmp/torchelastic_x2/none_y2"), "node1")
    ours = launch_agents([agent_identity(env(1), "node1"), agent_identity(env(1), "node1")])
    assert len(ours) == 1
    assert same_launch(ours, 0, ours, 1) and same_launch(ours, 1, ours, 3)
    assert not same_launch(ours, 1, ours, 1)  # not an earlier attempt: another launch, or this process itself
    assert not same_launch(ours, 0, ours, 0)  # a first attempt always starts a launch
    assert not same_launch(("other",), 0, ours, 1)
    # `--log-dir /dev/null`: no run directory (an empty error file); the agent's process names it, past a wrapper.
    quiet = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_ERROR_FILE": "", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert agent_identity(quiet, "node1", agent=lambda: "4242") == "none@node1:pid:4242"
    assert agent_identity(quiet, "node1", agent=lambda: "") == "none@node1:"  # no `/proc` to read
    assert agent_identity({"TORCHELASTIC_RUN_ID": "x"}, "node1", agent=lambda: "1") == "x@node1:"  # no agent at all
    worker = {"TORCHELASTIC_RESTART_COUNT": "2"}
    assert find_agent([(30, worker), (20, {"PATH": "/bin"}), (10, {})]) == 20  # train.sh (started by the agent)
    assert find_agent([(30, worker)]) is None
    # Two nodes: the rendezvous may give global rank 0 to the other node after a restart.
    two = launch_agents(["a@node2:/t/2", "a@node1:/t/1"])
    assert same_launch(("a@node1:/t/1",), 0, two, 1)


@pytest.mark.parametrize(
    "steps,newest,limit,keep,victims",
    [
        ([0, 4, 8, 12], 4, 2, [], []),  # an earlier run's 8 and 12 are not counted, and stay
        ([0, 4, 8, 12], 12, 2, [], [0, 4]),  # as transformers rotates, once this run reached them
        ([2, 4, 6, 8], 8, 2, [2], [4, 6]),  # the best model's checkpoint is kept
        ([2, 4, 6, 8], 8, 3, [2], [4]),
        ([2, 4, 6, 8], 8, 1, [2], [4, 6]),  # the newest and the best, even above the limit
        ([2, 4, 6], 6, None, [], []),
        ([2, 4, 6], 6, 0, [], []),
        ([6], 4, 1, [], []),
    ],
)
def test_rotation_never_deletes_the_newest_in_favour_of_higher_numbered_ones(steps, newest, limit, keep, victims):
    assert rotation_victims(steps, newest, limit, keep) == victims


def test_a_file_is_complete_when_it_parses_and_is_as_long_as_it_says(tmp_path):
    def cut(path, keep: float = 0.5) -> str:
        os.truncate(path, int(os.path.getsize(path) * keep))
        return str(path)

    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 8, "log_history": [{"loss": 1.0}] * 20}))
    assert incomplete_file(str(state)) is None
    assert incomplete_file(cut(state)).startswith("does not parse (JSONDecodeError")
    assert incomplete_file(cut(state, 0)) == "is empty"
    state.write_text("{}")
    assert incomplete_file(str(state)) == "holds no `global_step`"
    weights = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64), "b": torch.zeros(3, 5)}, str(weights))
    assert incomplete_file(str(weights)) is None
    assert incomplete_file(cut(weights, 0.9)).startswith("is truncated (its header places 316 bytes of tensors")
    assert incomplete_file(cut(weights, 0.01)).startswith("is truncated")
    optimizer = tmp_path / "optimizer.pt"
    torch.save({"state": {0: {"exp_avg": torch.ones(256)}}, "param_groups": []}, str(optimizer))
    assert incomplete_file(str(optimizer)) is None
    assert incomplete_file(cut(optimizer, 0.95)).startswith("is not a complete torch file")
    assert incomplete_file(str(tmp_path / "README.md")) is None  # not a file it knows


# ---------------------------------------------------------------------------------------------------- resume=True
def test_resume_true_passes_over_checkpoints_written_in_place_and_cut_short(toy_models, tmp_path):
    # As stock TRL or another tool writing in place leaves them after a crash: an empty `trainer_state.json`
    # (transformers: `JSONDecodeError`), a truncated weight file and a truncated optimizer state.
    out = str(tmp_path / "out")
    kw = dict(preset="guarded", trainer_cls=recording(trainer_class("dpo")), max_steps=8, save_steps=2)
    first = build_trainer("dpo", toy_models["qwen2"], out, **kw)
    first.train()
    for step, name, keep in [(8, "trainer_state.json", 0.0), (6, "model.safetensors", 0.7), (4, "optimizer.pt", 0.6)]:
        path = os.path.join(out, f"checkpoint-{step}", name)
        os.truncate(path, int(os.path.getsize(path) * keep))
    resumed = build_trainer("dpo", toy_models["qwen2"], out, **kw)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.seen == first.seen[2:]  # from checkpoint-2: steps 3-8, the same batches
    event = [e for e in read_events(out) if e["kind"] == "resume"][-1]
    passed = [(os.path.basename(p["checkpoint"]), p["reason"].split(" (")[0]) for p in event["passed_over"]]
    assert passed == [
        ("checkpoint-8", "incomplete: `trainer_state.json` is empty"),
        ("checkpoint-6", "incomplete: `model.safetensors` is truncated"),
        ("checkpoint-4", "incomplete: `optimizer.pt` is not a complete torch file"),
    ]


# ---------------------------------------------------------------------------------------------------- under torchrun
def fed(stream: list[dict], stage: int = 1) -> dict[int, list[int]]:
    """The steps each attempt fed to the model in `train()` call `stage` of the script."""
    out: dict[int, list[int]] = {}
    for line in stream:
        if line["event"] == "fed" and line.get("stage", 1) == stage:
            out.setdefault(line["attempt"], []).append(line["step"])
    return out


def resumes(run: str) -> list[dict]:
    return [e for e in read_events(run) if e["kind"] == "resume"]


@pytest.mark.distributed
def test_a_restart_after_train_returned_never_trains_past_max_steps(tmp_path):
    # A two-stage script (as SFT -> DPO): call 1 trains 8 steps in out/run and returns; call 2 starts from its model
    # in out/run2 and dies feeding step 6. The restarted script's call 1 trains nothing (no step 9, no checkpoint-9)
    # and returns what it returned before, with the same weights, loaded from its final checkpoint; call 2 goes on
    # from its checkpoint-4 with the same starting model.
    (result,), (stream,) = launch_restarting(
        tmp_path, 1, 1, "--stages", "2", "--kill_stage", "2", "--kill", "6:0", "--max_steps", "8"
    )
    assert fed(stream, 1) == {0: list(range(1, 9))}
    assert fed(stream, 2) == {0: [1, 2, 3, 4, 5, 6], 1: [5, 6, 7, 8]}
    returned = [json.loads(line) for line in (tmp_path / "out" / "stages-rank0.jsonl").read_text().splitlines()]
    first = [r for r in returned if r["stage"] == 1]
    assert [(r["attempt"], r["global_step"]) for r in first] == [(0, 8), (1, 8)]
    assert first[1] == {**first[0], "attempt": 1}  # the same loss, metrics and weights
    run = str(tmp_path / "out" / "run")
    assert checkpoint_steps(run) == [4, 8]
    record = read_progress(run)
    assert (record.phase, record.step, record.history.result["metrics"]) == ("finished", 8, first[0]["metrics"])
    assert [(e["checkpoint"], e["finished"]) for e in resumes(run)] == [(os.path.join(run, "checkpoint-8"), 8)]
    assert result["global_step"] == 8 and result["finite"]


@pytest.mark.distributed
def test_a_wrapper_script_is_restarted_from_its_checkpoint(tmp_path):
    # `torchrun --no-python train.sh`: each attempt runs python under a new shell; the restart still continues.
    (result,), (stream,) = launch_restarting(tmp_path, 1, 1, "--kill", "6:0", "--max_steps", "8", wrapper=True)
    assert fed(stream) == {0: [1, 2, 3, 4, 5, 6], 1: [5, 6, 7, 8]}
    assert_uninterrupted_batches(result, stream)
    assert [e["checkpoint"] for e in resumes(str(tmp_path / "out" / "run"))] == [
        str(tmp_path / "out" / "run" / "checkpoint-4")
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("logs", [(), ("--log-dir", os.devnull)], ids=["agent-logs", "no-agent-logs"])
def test_a_second_launch_with_the_same_rendezvous_is_not_a_restart_of_the_first(tmp_path, logs):
    # Two separate launches of one job script, both with `--rdzv-backend static` (`TORCHELASTIC_RUN_ID=none`), the
    # same host and command line. Launch B's first attempt dies loading, before `train()`; its restart finds launch
    # A's finished record and checkpoints, and must start over: neither return A's state nor resume A's checkpoint.
    # With `--log-dir /dev/null` the agent makes no run directory (`TORCHELASTIC_ERROR_FILE` is empty): both agents
    # were `none@host:`, and B's restart returned A's finished state without training a step. The agent process
    # itself (the nearest ancestor the agent did not start, the same for all its restarts) names it then.
    static = ("--rdzv-backend", "static", "--master-port", str(free_port()), *logs)
    launch_restarting(tmp_path, 1, 0, "--max_steps", "8", "--learning_rate", "5e-3", rendezvous=static, wrapper=True)
    (tmp_path / "out" / "stream-rank0.jsonl").unlink()
    (result,), (stream,) = launch_restarting(
        tmp_path, 1, 1, "--max_steps", "8", "--die_before_train", "0", rendezvous=static, wrapper=True
    )
    assert fed(stream) == {1: list(range(1, 9))}
    assert result["attempt"] == 1 and result["global_step"] == 8


@pytest.mark.distributed
def test_a_checkpoint_stamped_by_a_lagging_clock_is_still_this_launchs(tmp_path):
    # Shared storage whose server clock is an hour behind the node's: every published checkpoint's files carry a time
    # earlier than the launch itself. The restart still resumes from the launch's own checkpoint-4.
    (result,), (stream,) = launch_restarting(tmp_path, 1, 1, "--kill", "6:0", "--max_steps", "8", "--backdate", "3600")
    assert fed(stream) == {0: [1, 2, 3, 4, 5, 6], 1: [5, 6, 7, 8]}
    assert_uninterrupted_batches(result, stream)


@pytest.mark.distributed
def test_a_restart_passes_over_a_checkpoint_cut_short(tmp_path):
    # Attempt 0 publishes checkpoint-8, then its `trainer_state.json` is cut to half (written in place by another
    # tool), and dies feeding step 10. The restart passes over checkpoint-8, says why, and resumes from checkpoint-4.
    (result,), (stream,) = launch_restarting(
        tmp_path, 1, 1, "--kill", "10:0", "--max_steps", "10", "--truncate", "8:trainer_state.json"
    )
    assert fed(stream) == {0: list(range(1, 11)), 1: [5, 6, 7, 8, 9, 10]}
    assert_uninterrupted_batches(result, stream)
    (resume,) = resumes(str(tmp_path / "out" / "run"))
    (passed,) = resume["passed_over"]
    assert os.path.basename(passed["checkpoint"]) == "checkpoint-8"
    assert passed["reason"].startswith("incomplete: `trainer_state.json` does not parse (JSONDecodeError")


@pytest.mark.distributed
def test_rollback_from_disk_in_a_reused_output_dir_keeps_its_own_good_state(tmp_path):
    # Run A left checkpoints 4, 8 and 12 in the output_dir. Run B rolls back from disk with `save_total_limit=2`: its
    # checkpoint-0 (published at its start) and checkpoint-4 are its only good states; rotation must not delete them
    # in favour of A's higher-numbered 8 and 12. NaN weights at steps 3 and 6 roll back to 0 and to 4.
    launch_restarting(tmp_path, 1, 0, "--max_steps", "12", "--learning_rate", "5e-3")
    run = str(tmp_path / "out" / "run")
    assert checkpoint_steps(run) == [4, 8, 12]
    (result,), _ = launch_restarting(
        tmp_path, 1, 0, "--max_steps", "12", "--rollback_from", "checkpoint", "--save_total_limit", "2",
        "--fault", "weight:3", "--fault", "weight:6",
    )  # fmt: skip
    rollbacks = [e["restored_step"] for e in read_events(run) if e["kind"] == "rollback"]
    assert rollbacks == [0, 4]
    assert (result["global_step"], result["rollbacks"], result["finite"]) == (12, 2, True)
    assert checkpoint_steps(run) == [8, 12]  # B's own, rotated as transformers would once B reached them


def test_resuming_from_the_final_checkpoint_trains_no_step(toy_models, tmp_path):
    # transformers checks `max_steps` only after a step: resumed from the checkpoint of the last step it would train
    # one more (`global_step` 9 of 8, a checkpoint-9). The safe trainer stops before fetching a batch.
    first = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=8)
    first.train()
    again = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=8,
                          trainer_cls=recording(trainer_class("dpo")))  # fmt: skip
    output = again.train(resume_from_checkpoint=True)
    assert (output.global_step, getattr(again, "seen", []), checkpoint_steps(str(tmp_path))) == (8, [], [4, 8])
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), again.model.parameters()))
