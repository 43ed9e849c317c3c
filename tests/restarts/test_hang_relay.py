"""A hang seen on one rank reaches the main process's event log and reporting (`restarts/hang_relay.py`).

Rank 1's watchdog reported a step past its bound, the step then went on: the hang was in rank 1's stacks file and log
line only (the event log, the timeline, TensorBoard and W&B are the main process's). Its step, seconds and bound now
ride, in rank 1's slot of a vector, on the guard's per-step all-reduce, and the main process records the `hang` event.
The pure encoding and the rider's bookkeeping are tested in one process; the real relay on 2 CPU ranks (gloo) under
torchrun with tests/workers/restart_worker.py.
"""

from __future__ import annotations

import pytest
import torch
from test_crash_restarts import launch_restarting

from safe_trainers.guard import read_events
from safe_trainers.guard.step.flags import StepFlags
from safe_trainers.restarts.hang_relay import SLOT, Hang, HangRelay, hang_slots, relayed_hangs
from safe_trainers.restarts.hang_report import stacks_path
from safe_trainers.runtime.events import EventLog

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------------- pure encoding
def test_each_rank_fills_its_own_slot_and_the_maximum_holds_every_ranks_hang():
    assert hang_slots(0, 3, None) == [0.0] * (SLOT * 3)
    one = hang_slots(1, 3, Hang(step=7, seconds=4.5, bound=3.0))
    assert one == [0.0, 0.0, 0.0, 8.0, 4.5, 3.0, 0.0, 0.0, 0.0]  # step + 1: a hang at step 0 is still seen
    two = hang_slots(2, 3, Hang(step=0, seconds=130.2, bound=120.0))
    agreed = [max(values) for values in zip(hang_slots(0, 3, None), one, two)]
    assert relayed_hangs(agreed, own_rank=0) == [(1, Hang(7, 4.5, 3.0)), (2, Hang(0, 130.2, 120.0))]
    assert relayed_hangs(agreed, own_rank=1) == [(2, Hang(0, 130.2, 120.0))]  # its own hang is in its log already
    assert relayed_hangs(hang_slots(0, 3, None), own_rank=0) == []
    # float32 on the all-reduce: the step comes back exact, the seconds to a tenth.
    as_float32 = torch.tensor(hang_slots(1, 2, Hang(12345, 3.1, 3.0))).tolist()
    assert relayed_hangs(as_float32, own_rank=0) == [(1, Hang(12345, 3.1, 3.0))]


class Bit:
    """A scalar [`FlagRider`], as the preemption request is."""

    def __init__(self, value: bool):
        self.value, self.got = torch.tensor(value), []

    def local_bit(self, device):
        return self.value

    def agreed(self, step, bit):
        self.got.append((step, bit))


def test_a_vector_rides_the_guards_all_reduce_between_bits(tmp_path):
    # Two ranks simulated in one process: each relay hands the guard its vector; one process's all-reduce is the
    # identity, so rank 0's main process is given the element-wise maximum of both, as gloo's MAX gives it.
    events = [EventLog(str(tmp_path), write=(rank == 0)) for rank in range(2)]
    relays = [HangRelay(events[rank], str(tmp_path), rank, 2, main=(rank == 0)) for rank in range(2)]
    before, after = Bit(True), Bit(False)
    flags = StepFlags()
    flags.observe_loss(torch.tensor(1.0))
    relays[1].reported(3, {"seconds": 4.5, "bound": 3.0, "stacks": "x", "exited": False})
    flags.end_step(3, torch.tensor(0.5), CPU, riders=[before, relays[1], after])
    assert [(s, b.dtype, bool(b)) for s, b in before.got] == [(3, torch.bool, True)]
    assert [(s, bool(b)) for s, b in after.got] == [(3, False)]  # after the vector: its slice is skipped over
    assert relays[1]._agreed.pending[0][1].tolist() == [0.0, 0.0, 0.0, 4.0, 4.5, 3.0]


def run_steps(relays, steps):
    """Each step: every rank's local values, their maximum handed back to every rank, then the step's end."""
    for step in steps:
        agreed = torch.stack([relay.local_bit(CPU) for relay in relays]).amax(dim=0)
        for relay in relays:
            relay.agreed(step, agreed.clone())
            relay.step_ended(step)


def test_the_main_process_records_another_ranks_hang_one_step_later_and_once(tmp_path):
    out = str(tmp_path)
    events = [EventLog(out, write=(rank == 0)) for rank in range(2)]
    relays = [HangRelay(events[rank], out, rank, 2, main=(rank == 0)) for rank in range(2)]
    for relay in relays:
        relay.train_began()
    run_steps(relays, [1, 2])
    relays[1].reported(3, {"seconds": 4.46, "bound": 3.0, "stacks": "x", "exited": False})  # during step 3
    relays[0].reported(3, {"seconds": 4.0, "bound": 3.0})  # the main process's own: in its log already, not sent
    assert relays[0].local_bit(CPU).tolist() == [0.0] * 6
    run_steps(relays, [3])
    assert events[0].events == []  # step 3's values are read at the end of step 4 (no wait on the device)
    assert relays[1].local_bit(CPU).tolist() == [0.0] * 6  # relayed once: its slot is clear again
    run_steps(relays, [4, 5])
    [hang] = events[0].events
    assert (hang.step, hang.kind, hang.ranks) == (3, "hang", [1])
    assert hang.detail == {"seconds": 4.5, "bound": 3.0, "stacks": stacks_path(out, 1), "exited": False,
                           "relayed_from": 1}  # fmt: skip
    assert [e["ranks"] for e in read_events(out)] == [[1]]  # written by the main process
    assert events[1].events == []  # rank 1's own `hang` event is the watchdog's (`record_hang`), not the relay's
    # Two hangs before one all-reduce (a step's and the verification's after it): one per step, none lost.
    relays[1].reported(6, {"seconds": 5.0, "bound": 3.0})
    relays[1].reported(6, {"seconds": 6.0, "bound": 3.0})
    run_steps(relays, [6, 7, 8])
    assert [(e.step, e.detail["seconds"]) for e in events[0].events[1:]] == [(6, 5.0), (6, 6.0)]
    # The last step's values are read when training ends (no further step reads them).
    relays[1].reported(9, {"seconds": 7.0, "bound": 3.0})
    run_steps(relays, [9])
    for relay in relays:
        relay.train_ended()  # one process: no collective, the values already agreed are read
    assert [(e.step, e.detail["seconds"]) for e in events[0].events[3:]] == [(9, 7.0)]


# ---------------------------------------------------------------------------------------------------- two real ranks
@pytest.mark.distributed
def test_a_hang_on_rank_1_only_reaches_rank_0s_event_log_and_tensorboard(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Rank 1 sleeps 8 s in steps 3 and 6 (the last) with a bound of 3 s (`hang_action="report"`: it goes on); rank
    # 0's bound is 900 s, so only rank 1's watchdog sees a hang (rank 0 waits for it in the step's collectives, within
    # its bound). Step 3's hang is read at the end of step 4, the last step's when training ends.
    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))  # read by transformers' writer in the workers
    results, _ = launch_restarting(
        tmp_path, 2, 0, "--slow", "3:8:1", "--slow", "6:8:1", "--hang_timeout", "900", "--hang_timeout_on", "1:3",
        "--hang_action", "report", "--max_steps", "6", "--save_steps", "6", "--report_to", "tensorboard",
    )  # fmt: skip
    run = tmp_path / "out" / "run"
    assert [r["global_step"] for r in results] == [6, 6]  # the run finished
    stacks = (run / "hang-stacks-rank1.txt").read_text()
    assert "step 3 has run" in stacks and "step 6 has run" in stacks
    assert not (run / "hang-stacks-rank0.txt").exists()
    hangs = [e for e in read_events(str(run)) if e["kind"] == "hang"]
    assert [(e["step"], e["ranks"], e["relayed_from"], e["exited"]) for e in hangs] == [
        (3, [1], 1, False), (6, [1], 1, False),
    ]  # fmt: skip
    assert all(e["stacks"] == str(run / "hang-stacks-rank1.txt") and e["bound"] == 3.0 for e in hangs)
    assert all(e["seconds"] >= e["bound"] for e in hangs)  # past the bound, rounded to 0.1 s (3.04 reads 3.0)
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    assert [s.step for s in accumulator.Scalars("nan_guard/events/hang")] == [3, 6]
    said = [t.tensor_proto.string_val[0].decode() for t in accumulator.Tensors("nan_guard/events/text_summary")]
    assert [line.splitlines()[0] for line in said if "hang" in line] == [
        f"step {e['step']}: hang; {e['seconds']} s; on rank 1" for e in hangs
    ]


@pytest.mark.distributed
def test_a_watchdog_off_on_rank_0_only_neither_breaks_the_all_reduce_nor_loses_rank_1s_hang(tmp_path):
    # `hang_timeout=0` on rank 0, 3 s on rank 1: the ranks must still hand the guard's all-reduce the same riders
    # (the relay's vector was built on rank 1 only: gloo aborted, "Received data size doesn't match expected size",
    # NCCL would hang or read past the buffer). Rank 0 times no step, but records rank 1's hang of step 3.
    results, _ = launch_restarting(
        tmp_path, 2, 0, "--slow", "3:8:1", "--hang_timeout", "0", "--hang_timeout_on", "1:3",
        "--hang_action", "report", "--max_steps", "4", "--save_steps", "4",
    )  # fmt: skip
    run = tmp_path / "out" / "run"
    assert [r["global_step"] for r in results] == [4, 4]
    hangs = [e for e in read_events(str(run)) if e["kind"] == "hang"]
    assert [(e["step"], e["ranks"], e["relayed_from"]) for e in hangs] == [(3, [1], 1)]


@pytest.mark.distributed
def test_a_hang_at_the_step_a_preemption_stops_at_is_relayed_before_the_process_exits(tmp_path):
    # Rank 0 is sent SIGTERM in step 3: every rank stops after step 4, saves checkpoint-4 and exits (status 75, raised
    # from the step's boundary: no `on_train_end`, no further step to read step 4's agreed values). Rank 1's step 4
    # ran past its bound of 3 s: its hang rode step 4's all-reduce and must reach rank 0's log before the exit (the
    # restart resumes from checkpoint-4 and keeps the events up to step 4).
    results, _ = launch_restarting(
        tmp_path, 2, 1, "--preempt", "3:0:0", "--slow", "4:8:1", "--hang_timeout", "900", "--hang_timeout_on", "1:3",
        "--hang_action", "report", "--max_steps", "6", "--save_steps", "6",
    )  # fmt: skip
    run = tmp_path / "out" / "run"
    assert [(r["attempt"], r["global_step"]) for r in results] == [(1, 6), (1, 6)]
    assert "step 4 has run" in (run / "hang-stacks-rank1.txt").read_text()
    events = read_events(str(run))
    assert [e["step"] for e in events if e["kind"] == "preempt"] == [4]
    hangs = [e for e in events if e["kind"] == "hang"]
    assert [(e["step"], e["ranks"], e["relayed_from"]) for e in hangs] == [(4, [1], 1)]
