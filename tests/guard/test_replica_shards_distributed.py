"""The host snapshot sharded over DDP ranks (`guard/rollback/replica_shards.py`), on real trainers: 2 and 3 CPU ranks
(gloo) through `accelerate launch`.

Each rank holds about 1/N of the snapshot's bytes; a rollback puts the whole state back on every rank, bit for bit
the state the snapshot was taken of (what the unsharded restore gives: an exact copy); a rank that lost its shard
makes the rollback load the newest verified checkpoint instead, with a `shard_missing` event.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from net_utils import free_port
from test_guard_distributed import WORKER, accelerate_ddp, run_cases, run_workers

from safe_trainers.guard import read_events
from safe_trainers.testing.toy import save_toy_model

pytestmark = pytest.mark.distributed
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# AdamW's 0-dim step counters stay whole on every rank: 4 bytes per parameter tensor, beyond the S/N share.
STEP_COUNTER_BYTES = 4


# The two-rank runs of this module, one `accelerate launch` for all (the worker's `--jobs`): by name, the worker's
# arguments. Each names the step a NaN weight hits rank 0 at; `--drop_shard STEP:RANK` has that rank drop its shard.
TWO_RANK_RUNS = {
    "rollback-6": ["--fault", "weight:6:0"],
    "rollback-2": ["--fault", "weight:2:0"],
    "lost-shard": ["--fault", "weight:6:0", "--drop_shard", "5:1", "--save_steps", "3"],
    "lost-shard-no-checkpoint": ["--fault", "weight:6:0", "--drop_shard", "4:1", "--save_steps", "100"],
}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("two-ranks")
    model = save_toy_model(str(root / "model"), "qwen2")
    jobs = {name: ["--kind", "dpo", "--model", model, "--probe", *args] for name, args in TWO_RANK_RUNS.items()}
    return run_cases(root, accelerate_ddp(), jobs)


def three_rank_run(tmp_path, *extra: str) -> tuple[list[dict], Path]:
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out = str(tmp_path / "out")
    command = accelerate_ddp(3) + [WORKER, "--kind", "dpo", "--model", model, "--out", out, "--probe", *extra]
    return run_workers(command, [out], tmp_path, ranks=3)[0], tmp_path / "out"


@pytest.mark.parametrize("ranks,fault,restored", [(2, 6, 4), (3, 6, 4), (2, 2, 0)])
def test_rollback_restores_the_whole_state_from_shards(request, tmp_path, ranks, fault, restored):
    # A NaN weight on rank 0 at step 6: every rank skips it and rolls back to the snapshot of step 4 (one every 2
    # steps), which each rank holds a third or a half of. At step 2: back to the snapshot taken when training
    # started, before the optimizer had any moments (the live ones are dropped).
    if ranks == 2:
        results, out = request.getfixturevalue("two_rank_runs")[f"rollback-{fault}"]
    else:
        results, out = three_rank_run(tmp_path, "--fault", f"weight:{fault}:0")
    events = read_events(os.path.join(str(out), "run"))
    assert [(e["step"], e["kind"]) for e in events] == [(fault, "skip"), (fault, "rollback")]
    assert events[1]["restored_step"] == restored
    for r in results:
        assert r["outcome"] == "finished" and r["finite"] and r["global_step"] == 8
        # Right after the rollback: bit for bit the weights and AdamW moments of the snapshot's step, which an
        # unsharded restore (an exact copy) gives.
        assert r["digests"][str(fault)] == r["digests"][str(restored)]
        # This rank's host copy: about 1/N of the state, plus the replicated step counters.
        share = r["state_bytes"] / ranks
        assert share - 8 <= r["host_bytes"] <= share + 8 + STEP_COUNTER_BYTES * 64, (r["host_bytes"], share)
    # The same state on every rank, at every step.
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert len({r["checksum"] for r in results}) == 1


def test_a_lost_shard_falls_back_to_the_newest_checkpoint(two_rank_runs):
    # Checkpoints at steps 3 and 6, snapshots at 2, 3 (the save) and 5 (two steps after it); rank 1 loses its shard
    # after step 5 (as a process that replaced it would have none), and a NaN weight on rank 0 at step 6 needs a
    # rollback: every rank loads checkpoint-3 instead, and says so.
    results, out = two_rank_runs["lost-shard"]
    events = read_events(os.path.join(str(out), "run"))
    assert [(e["step"], e["kind"]) for e in events] == [(6, "skip"), (6, "shard_missing"), (6, "rollback")]
    missing, rollback = events[1], events[2]
    assert missing["ranks"] == [1] and missing["loads"].endswith("checkpoint-3") and missing["snapshot_step"] == 5
    assert rollback["restored_step"] == 3
    for r in results:
        assert r["outcome"] == "finished" and r["finite"] and r["global_step"] == 8
        assert r["digests"]["6"] == r["digests"]["3"]  # the checkpoint's weights and moments, on every rank
    assert all(r["digests"] == results[0]["digests"] for r in results)


def test_a_lost_shard_without_a_checkpoint_stops_the_run(two_rank_runs):
    # No checkpoint published yet (`save_steps` past the rollback): nothing to load instead, so the run stops like a
    # disk rollback with no good state, with an `abort` event after the `shard_missing` one. (The launch's next run,
    # if any, trains on in the same processes: a script that catches the error and goes on.)
    results, out = two_rank_runs["lost-shard-no-checkpoint"]
    events = read_events(os.path.join(str(out), "run"))
    assert [(e["step"], e["kind"]) for e in events] == [(6, "skip"), (6, "shard_missing"), (6, "abort")]
    assert events[1]["loads"] is None and events[2]["reason"] == "no_good_state"
    assert all(r["outcome"] == "diverged: None" for r in results)


def test_the_memory_bench_measures_ddp_ranks():
    # `bench/guard_memory.py --ddp`: two fresh launches of 2 ranks (guard off, guard on) and a row against S/N.
    command = [sys.executable, os.path.join(REPO, "bench", "guard_memory.py"), "--ddp", "2", "--steps", "2"]
    # A port of this worker's block (`free_port`): the OS's pick, in the ephemeral range, could be taken by a
    # connection of a launch running on the other worker while this one imports.
    command += ["--seq", "16", "--sizes", "128x2", "--master-port", str(free_port())]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| 2 ")]
    assert len(rows) == 1, done.stdout[-3000:]
    share, held = float(rows[0][4]), float(rows[0][5])  # S/N and the snapshot held per rank, in MiB
    assert share > 0 and abs(held - share) <= 0.1 * share + 0.01, rows
