"""One run per `output_dir` (issue 28): a second run is refused while the first trains, the lock goes with its
process, and nodes sharing storage with `save_on_each_node=True` never remove what another published.

The runs are real processes: tests/workers/restart_worker.py, paused mid-training (`--pause`) or launched as two
torchrun "nodes" on this machine (`--nnodes 2`, one agent each, one output_dir: shared storage).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from guard_utils import checkpoint_steps
from net_utils import EXIT_RACE, StubHub, free_port
from test_crash_restarts import REPO, WORKER

from safe_trainers.errors import OutputDirInUseError
from safe_trainers.guard import read_events
from safe_trainers.runtime.checkpoint_dirs import STAGING_DIR
from safe_trainers.restarts.checkpoint_choice import checkpoint_problem
from safe_trainers.restarts.output_lock import LOCK_FILE, Holder, decide, read_holder
from safe_trainers.restarts.progress import PROGRESS_FILE, read_progress
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.toy import save_toy_model

ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")


def test_the_lock_file_names_a_holder_and_which_part_each_process_takes():
    ours = Holder("node1", 10, ("a@node1:/t/1",), restart=2, token="t2")
    # The lock taken, none to take (a filesystem without locks), or this launch's rank 0 on the same storage.
    assert decide(ours, None, True) == "holds"
    assert decide(ours, None, None) == "unlocked"
    assert decide(ours, Holder("node0", 7, ours.launch, 2, "t2"), True) == "peer"
    # Held: by an earlier attempt of this launch (its workers were stopped before the restart), or by another run.
    assert decide(ours, Holder("node0", 7, ours.launch, 1, "t1"), False) == "after_dead_attempt"
    assert decide(ours, Holder("node0", 7, ours.launch, 2, "t9"), False) == "refused"  # not an earlier attempt
    assert decide(ours, Holder("node0", 7, ("b@node0:/t/9",), 0, "t9"), False) == "refused"
    assert decide(Holder("h", 1, ("@h:",), 0, "x"), Holder("h", 2, ("@h:",), 0, "y"), False) == "refused"  # python
    assert decide(ours, None, False) == "refused"  # its file names no holder yet
    assert Holder.from_json(ours.to_json()) == ours
    for text in ["", '{"host": "h", "pi', "[]", '{"host": "h"}', "\x00" * 8]:
        assert Holder.from_json(text) is None


@pytest.mark.slow  # a process of its own, or a real run
def test_a_second_run_is_refused_while_the_first_trains_and_the_first_keeps_its_checkpoints(tmp_path):
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out, run = tmp_path / "out", tmp_path / "out" / "run"
    cmd = [sys.executable, WORKER, "--model", model, "--out", str(out), "--pause", "6:0", "--max_steps", "8"]
    first = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not (out / "paused-rank0").exists():  # run A is inside step 6, checkpoint-4 published
            assert first.poll() is None, first.stdout.read()[-4000:]
            time.sleep(0.1)
        record, entries = (run / PROGRESS_FILE).read_bytes(), sorted(os.listdir(run))
        second = build_trainer("dpo", model, str(run), preset="guarded", max_steps=8)
        with pytest.raises(OutputDirInUseError) as refused:
            second.train()
        message = str(refused.value)
        assert f"`output_dir={str(run)!r}` is in use by another training run" in message
        assert f"process {first.pid} on host {socket.gethostname()!r} holds its lock" in message
        assert (refused.value.host, refused.value.pid) == (socket.gethostname(), first.pid)
        # B touched nothing of A's: its step record, its event log (none yet), its published checkpoint.
        assert (run / PROGRESS_FILE).read_bytes() == record and sorted(os.listdir(run)) == entries
        assert checkpoint_steps(str(run)) == [4]
    finally:
        (out / "go").touch()
        stdout, _ = first.communicate(timeout=600)
    assert first.returncode == 0, stdout[-4000:]
    result = json.loads((out / "result-rank0.json").read_text())
    assert (result["attempt"], result["global_step"], result["finite"]) == (0, 8, True)
    assert checkpoint_steps(str(run)) == [4, 8]
    assert all(checkpoint_problem(str(run / f"checkpoint-{s}")) is None for s in (4, 8))
    progress = read_progress(str(run))
    assert progress.phase == "finished" and progress.history.checkpoints == (4, 8)
    assert not [e for e in read_events(str(run)) if e["kind"] == "resume"]
    # The lock went with its process: a new run trains in the same output_dir, and the same trainer again after it.
    assert read_holder(str(run / LOCK_FILE)).pid == first.pid  # the file stays; the kernel dropped the lock
    assert second.train(resume_from_checkpoint=True).global_step == 8  # from A's final checkpoint: no step
    assert second.train().global_step == 8
    assert read_holder(str(run / LOCK_FILE)).pid == os.getpid()


@pytest.mark.slow  # a process of its own, or a real run
def test_the_lock_holds_while_the_run_uploads_its_output_dir_to_the_hub(tmp_path):
    # `push_to_hub=True` uploads `output_dir` at every save, from the run's own process: the upload reads every file
    # there, the lock file too. A POSIX record lock is dropped when its process closes any descriptor of the file.
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out, run = tmp_path / "out", tmp_path / "out" / "run"
    hub = StubHub()
    env = dict(ENV, HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_XET="1")
    cmd = [sys.executable, WORKER, "--model", model, "--out", str(out), "--pause", "6:0", "--max_steps", "8", "--push"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not (out / "paused-rank0").exists():  # run A is inside step 6; checkpoint-4 published and uploaded
            assert first.poll() is None, first.stdout.read()[-4000:]
            time.sleep(0.1)
        uploads = [body for _, path, body in hub.requests if path.endswith("/preupload/main")]
        assert uploads and b"model.safetensors" in uploads[0], hub.requests
        assert not any(LOCK_FILE.encode() in body for body in uploads)  # never the lock file (its host name, pid)
        second = build_trainer("dpo", model, str(run), preset="guarded", max_steps=8)
        with pytest.raises(OutputDirInUseError):
            second.train()
    finally:
        (out / "go").touch()
        stdout, _ = first.communicate(timeout=600)
        hub.close()
    assert first.returncode == 0, stdout[-4000:]
    assert checkpoint_steps(str(run)) == [4, 8]


@pytest.mark.slow  # a process of its own, or a real run
def test_a_lock_left_by_a_killed_process_never_blocks_the_next_run(tmp_path):
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out, run = tmp_path / "out", tmp_path / "out" / "run"
    cmd = [sys.executable, WORKER, "--model", model, "--out", str(out), "--kill", "6:0", "--max_steps", "8"]
    killed = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-4000:]  # SIGKILL inside step 6, holding the lock
    resumed = build_trainer("dpo", model, str(run), preset="guarded", max_steps=8)
    assert resumed.train(resume_from_checkpoint=True).global_step == 8
    assert [e["checkpoint"] for e in read_events(str(run)) if e["kind"] == "resume"] == [str(run / "checkpoint-4")]


@pytest.mark.distributed
def test_two_nodes_saving_on_each_node_to_shared_storage_never_remove_what_the_other_published(tmp_path):
    # Two torchrun agents on this machine (`--nnodes 2`, one worker each: each worker is its node's local main and
    # saves, `save_on_each_node=True`) with one output_dir: two nodes on shared storage. Node 1 finds node 0's lock
    # token there and leaves publishing and rotation to it.
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out, run = tmp_path / "out", tmp_path / "out" / "run"
    port = str(free_port())
    args = ["--model", model, "--out", str(out), "--save_on_each_node", "--max_steps", "8", "--save_total_limit", "1"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, WORKER, *args],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path),
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    finished = all((out / f"result-rank{rank}.json").exists() for rank in (0, 1))
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0 or (EXIT_RACE in output and finished), output[-4000:]
    results = [json.loads((out / f"result-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["global_step"] for r in results] == [8, 8] and results[0]["checksum"] == results[1]["checksum"]
    assert checkpoint_steps(str(run)) == [8] and checkpoint_problem(str(run / "checkpoint-8")) is None
    assert not (run / STAGING_DIR).exists()
    assert read_progress(str(run)).history.checkpoints == (8,)


@pytest.mark.distributed  # two torchrun agents: a launch
def test_an_error_taking_the_lock_on_rank_0_is_raised_on_every_node_not_waited_for(tmp_path):
    # The lock file is a link (refused on purpose, ELOOP): rank 0 cannot take the lock. Two torchrun agents ("nodes"),
    # so no launcher stops node 1 when node 0 fails: before, node 1 waited in the collective for rank 0's answer until
    # the process-group timeout; now the error reaches it and both end at once with the message.
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out, run = tmp_path / "out", tmp_path / "out" / "run"
    run.mkdir(parents=True)
    (tmp_path / "elsewhere").write_text("not the run's\n")
    os.symlink(tmp_path / "elsewhere", run / LOCK_FILE)
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, WORKER,
             "--model", model, "--out", str(out), "--max_steps", "4"],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path),
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, output in zip(nodes, outputs):
        assert node.returncode != 0 and "is a symbolic link: the run's lock file must be a plain file" in output
    assert (tmp_path / "elsewhere").read_text() == "not the run's\n"
