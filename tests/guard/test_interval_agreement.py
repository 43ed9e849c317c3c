"""Every rank chooses the same snapshot interval (`guard/snapshot_interval.py`), whatever its own timing: the ranks
take their snapshots, and run the collectives of their checks, at the same steps only if they do.

The measured figures are agreed across ranks at each decision (the largest rank's); so must be everything else a
decision reads. The debt of the one-time costs (`SnapshotInterval.debt`) is this rank's own snapshot time against its
own clock: a rank that waits for a straggler inside a snapshot's check (a collective) counts that wait as snapshot
time, the straggler does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from net_utils import EXIT_RACE, free_port

from safe_trainers.arguments import SafetyArguments
from safe_trainers.guard.snapshot_interval import SnapshotInterval
from safe_trainers.runtime.events import EventLog
from safe_trainers.testing.toy import save_toy_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "workers", "guard_worker.py")


class Source:
    def allocation_seconds(self) -> float:
        return 0.0

    def copy_delay_seconds(self) -> float | None:
        return 0.0


def started(tmp_path, name: str, waited: float, budget: float = 0.01, lower: int | None = None):
    """One rank's interval after its first snapshot, whose check waited `waited` seconds for the other ranks."""
    events = EventLog(str(tmp_path / name), write=False)
    interval = SnapshotInterval(SafetyArguments(nan_snapshot_budget=budget, nan_snapshot_steps=lower))
    interval.start(type("Config", (), {"save_strategy": "steps", "save_steps": 10_000})(), None, say=False)
    state = type("State", (), {"global_step": 0, "max_steps": 1000})()
    with interval.timed():
        time.sleep(waited)  # the check's collective: this rank arrived first and waited
    interval.after_snapshot(state, Source(), type("Port", (), {"device": "cpu"})(), events)
    return interval, events


def test_ranks_given_the_same_agreed_figures_choose_the_same_interval(tmp_path):
    early, _ = started(tmp_path, "rank0", 0.05)  # waited 50 ms in the first check for the straggler
    late, _ = started(tmp_path, "rank1", 0.0)  # the straggler: no wait
    # What the all-reduce agreed, the same on both ranks: the cost, the step time and the debt (the largest rank's).
    figures = (0.001, 0.1, 0.01)
    early.decide(10, figures, EventLog(str(tmp_path / "e0"), write=False))
    late.decide(10, figures, EventLog(str(tmp_path / "e1"), write=False))
    assert early.steps == late.steps == 22  # ceil((1 + 10 ms) / (half of 1% x 100 ms))


@settings(max_examples=10, deadline=None)
@given(
    waits=st.tuples(st.floats(0, 0.01), st.floats(0, 0.01)),
    figures=st.lists(st.tuples(st.floats(0, 1), st.floats(1e-3, 1), st.floats(0, 10)), min_size=1, max_size=4),
    budget=st.sampled_from([1e-9, 1e-3, 0.01, 0.5]),
    lower=st.integers(1, 4),
)
def test_the_interval_is_a_function_of_the_agreed_figures_alone(tmp_path_factory, waits, figures, budget, lower):
    # Whatever each rank's own timing (its snapshots' host time, its clock), the same agreed figures give the same
    # interval on every rank, within the bounds.
    root = tmp_path_factory.mktemp("ranks")
    ranks = []
    for rank, waited in enumerate(waits):
        interval, events = started(root, f"rank{rank}", waited, budget=budget, lower=lower)
        for step, agreed in enumerate(figures, start=1):
            interval.decide(10 * step, agreed, events, estimated=step == 1)
        ranks.append((interval.steps, [(e.step, e.detail["interval"]) for e in events.events]))
    assert ranks[0] == ranks[1]
    assert lower <= ranks[0][0] <= max(lower, 10_000)


def launch(tmp_path, *extra: str, timeout: int = 420) -> tuple[list[dict | None], str]:
    """Two DDP ranks of the guard worker; a rank that did not finish (a hang, a crash) has `None`."""
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out = str(tmp_path / "out")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), WORKER, "--kind", "sft", "--model", model, "--out", out, *extra,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
        log = done.stdout + done.stderr
        ok = done.returncode == 0 or EXIT_RACE in done.stderr
    except subprocess.TimeoutExpired as expired:  # the ranks' collectives no longer line up
        log, ok = f"timed out after {timeout} s: {expired.stderr or ''}", False
    results = []
    for rank in (0, 1):
        path = os.path.join(out, f"result-rank{rank}.json")
        results.append(json.load(open(path)) if ok and os.path.exists(path) else None)
    return results, log[-4000:]


@pytest.mark.distributed
def test_a_straggler_at_a_snapshot_leaves_the_ranks_on_the_same_interval(tmp_path):
    # Rank 1 is slow once, after step 4's optimizer step (a snapshot step: every 2 at first): rank 0 waits for it in
    # that snapshot's check. Both ranks agree on the figures (the largest: rank 0's cost, the wait included), but only
    # rank 0 counts the wait as debt, so rank 0 stretches further: their snapshots (and the collectives of their
    # checks) no longer fall on the same steps.
    extra = ["--max_steps", "40", "--save_steps", "1000", "--snapshot_steps", "2", "--snapshot_budget", "0.1"]
    results, log = launch(tmp_path, *extra, "--slow_rank", "4:1:1.0")
    assert all(r is not None for r in results), log
    assert [r["outcome"] for r in results] == ["finished", "finished"]
    intervals = [[(e["interval"], e["previous"]) for e in r["intervals"]] for r in results]
    assert intervals[0] == intervals[1], intervals
    assert results[0]["checksum"] == results[1]["checksum"]
