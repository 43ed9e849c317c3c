"""`guard/nan_guard.py` on its own: a [`NanGuard`] over a fake port (a tiny model, a real fused `AdamW`, a
`TrainerState`; no trainer), driven through its doors in the order the integration layer calls them, one optimizer
step at a time, with real faults (`tests/loop_utils.py`). Each test states one contract of `NanGuard` (the NaN-step
path of `docs/design/layout.md`). What only a trainer can do (replay a batch through its loss, load or save a
checkpoint) the guard returns as a decision; where a contract is such an action, the test asserts the decision."""

from __future__ import annotations

import math

import pytest
import torch
from host_reads import HostReads  # tests/ is on sys.path
from loop_utils import LEARNING_RATE, Loop, optimizer_state, same, trainable
from transformers import TrainerControl

from safe_trainers.guard.rollback.memory import HostSnapshot
from safe_trainers.guard.state import GuardState
from safe_trainers.guard.step.skip import route_for
from safe_trainers.runtime.events import read_events

# ---------------------------------------------------------------------------------------------------- start
def test_begin_binds_to_the_optimizer_and_snapshots_the_starting_state(tmp_path):
    """`begin` also answers whether the caller must publish a starting checkpoint: not with the memory source."""
    loop = Loop(tmp_path)
    before = trainable(loop.model)
    assert loop.begin() is False
    guard = loop.guard
    assert guard.backend.optimizer is loop.optimizer and guard.backend.zero_stage is None
    assert guard.rollback_from == "memory" and isinstance(guard.snapshotter, HostSnapshot)
    snap = guard.snapshotter.snapshot
    assert snap.step == 0 and same(snap.params, before)  # the weights training starts from, copied
    assert guard.verified_step == 0 and guard.flags.pending == []


def test_begin_refuses_a_state_that_is_already_nonfinite(tmp_path):
    loop = Loop(tmp_path)
    loop.poison_a_weight()
    with pytest.raises(ValueError, match=r"already non-finite before the first step \(rank\(s\) \[0\]\)"):
        loop.begin()


def test_a_new_run_undoes_the_previous_backoff_and_a_resumed_one_keeps_its_counters(tmp_path):
    loop = Loop(tmp_path)
    loop.begin()
    guard, optimizer = loop.guard, loop.optimizer
    lr = optimizer.param_groups[0]["lr"]
    guard.state.lr_scale, guard.state.skipped_steps = 0.25, 3
    optimizer.param_groups[0]["lr"] = lr * 0.25  # as two rollbacks at `nan_lr_backoff=0.5` left it
    guard.start_run(None, optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr) and guard.state == GuardState(learning_rate=1e-3)

    checkpoint = tmp_path / "checkpoint-6"
    checkpoint.mkdir(parents=True)
    GuardState(skipped_steps=2, rollbacks=1, lr_scale=0.5, learning_rate=1e-3).save(str(checkpoint))
    guard.start_run(str(checkpoint), optimizer)
    assert (guard.state.skipped_steps, guard.state.rollbacks, guard.state.lr_scale) == (2, 1, 0.5)
    assert guard.resumed_from == str(checkpoint) and guard.rollbacks_this_run == 0


def test_a_changed_learning_rate_on_resume_is_scaled_to_with_the_backoff_kept(tmp_path):
    loop = Loop(tmp_path)
    loop.begin()
    guard, optimizer = loop.guard, loop.optimizer
    guard.state.learning_rate = 4e-3  # the run was configured with 4e-3; now `learning_rate=1e-3`
    optimizer.param_groups[0]["lr"] = 2e-3  # its checkpoint's LR: 4e-3 after one backoff of 0.5
    guard.resumed_learning_rate(optimizer, loop.port.scheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3) and guard.state.learning_rate == LEARNING_RATE


# ---------------------------------------------------------------------------------------------------- the hot path
def test_a_nonfinite_loss_sets_the_skip_flag_on_the_device_without_a_host_read(tmp_path):
    loop = Loop(tmp_path, faults={1: "loss"})
    loop.begin()
    guard = loop.guard
    assert route_for(loop.optimizer, None) == "found_inf"  # fused AdamW: skipped on the device
    loss = loop.forward()
    assert math.isnan(loss.item())  # the injected fault
    grad_norm = loop.clip()
    with HostReads() as reads:
        skip = loop.close(loss, grad_norm)
    assert reads.reads == []  # observe_loss, end_of_step and apply_skip read nothing back
    assert torch.is_tensor(skip) and bool(skip)
    assert len(guard.flags.pending) == 1 and guard.events.events == [] and guard.state.skipped_steps == 0
    loop.update()
    with HostReads() as reads:
        decision = loop.inspect()
    assert reads.reads  # the inspection is where the flags come back to the host
    verdict = decision.verdict
    assert [r.step for r in verdict.skipped] == [1] and verdict.rollback is None and not decision.restore


def test_apply_skip_keeps_the_faulted_update_out_of_the_weights_and_the_optimizer(tmp_path):
    loop = Loop(tmp_path, faults={2: "loss"})
    loop.begin()
    before = trainable(loop.model)
    assert not bool(loop.step())  # a healthy step is applied
    applied = trainable(loop.model)
    assert not same(applied, before)
    moments = optimizer_state(loop.optimizer)
    assert bool(loop.step())  # NaN loss, NaN gradients: skipped
    assert same(trainable(loop.model), applied)  # not one weight moved, none went NaN
    after = optimizer_state(loop.optimizer)
    assert len(after) == len(moments) and all(torch.equal(a, b) for a, b in zip(after, moments))  # step count too
    assert "found_inf" not in vars(loop.optimizer)  # taken back after the step


def test_inspect_records_the_skip_with_the_module_that_went_nonfinite(tmp_path):
    """The guard hands the faulted step's batches back for the replay (`Judged.replay`, replayed by the caller) and
    records the diagnosis it is given with the skip."""
    loop = Loop(tmp_path, faults={2: "loss"})
    loop.begin()
    loop.step(), loop.step()
    guard = loop.guard
    decision = loop.inspect()
    verdict = decision.verdict
    assert [r.step for r in verdict.skipped] == [2] and verdict.rollback is None and guard.flags.pending == []
    assert loop.judged.replay_step == 2 and len(loop.judged.replay) == 1  # the step's one micro-batch, to replay
    (event,) = [e for e in guard.events.events]
    # NaN activations make a NaN loss on rank 0, and NaN gradients.
    assert (event.step, event.kind, event.nonfinite, event.ranks) == (2, "skip", ["loss", "grad_norm"], [0])
    # The fault poisons the last layer's output: the replay names that layer.
    assert event.detail["first_nonfinite_module"]["module"] == "layers.1"
    assert guard.state.skipped_steps == 1 and guard.state.counters()["nan_guard/skipped_steps"] == 1
    assert [e["kind"] for e in read_events(str(tmp_path))] == ["skip"]  # written to `nan_events.jsonl`


def test_record_inputs_keeps_the_steps_batches_for_the_diagnosis_until_the_inspection(tmp_path):
    loop = Loop(tmp_path, faults={1: "loss", 2: "loss"})
    loop.begin()
    guard = loop.guard
    loop.step()
    (batch,) = guard.batches.get(1)  # one micro-batch, its inputs as the model got them
    assert batch["x"].shape[0] == loop.batch["x"].shape[0] and torch.equal(batch["x"], loop.batch["x"])
    loop.inspect()
    assert guard.batches.get(1) == []  # dropped at the inspection
    assert "first_nonfinite_module" in guard.events.events[0].detail
    guard.state.localized = False  # the diagnosis runs once per run: allow another
    loop.step(record=False)
    loop.inspect()
    assert loop.judged.replay == []  # nothing handed back to replay
    skip = guard.events.events[1]
    assert (skip.step, skip.kind) == (2, "skip") and "first_nonfinite_module" not in skip.detail  # nothing to replay


def test_at_boundary_inspects_only_where_the_trainer_logs_saves_or_a_snapshot_is_due(tmp_path):
    loop = Loop(tmp_path)  # `nan_snapshot_steps=2`
    loop.begin()
    guard = loop.guard
    loop.step()
    assert guard.due(TrainerControl()) is None and len(guard.flags.pending) == 1  # nothing due at step 1
    loop.step()
    assert loop.boundary(TrainerControl()) is not None  # step 2: a snapshot is due
    assert guard.flags.pending == [] and guard.snapshotter.snapshot.step == 2
    loop.step()
    assert loop.boundary(TrainerControl(should_log=True)) is not None  # a log: inspected, no snapshot
    assert guard.snapshotter.snapshot.step == 2
    loop.step(), loop.step()  # steps 4 (a snapshot, not asked for here) and 5
    assert loop.boundary(TrainerControl(should_save=True)) is not None  # a save: verified, a snapshot
    assert guard.snapshotter.snapshot.step == 5 and guard.verified_step == 5


# ---------------------------------------------------------------------------------------------------- the state
def test_state_is_finite_flips_with_a_nan_weight_and_a_verified_step_is_trusted(tmp_path):
    loop = Loop(tmp_path)
    loop.begin()
    guard = loop.guard
    loop.step()
    assert guard.state_is_finite() and guard.damaged_ranks == [] and guard.verified_step == 1
    loop.poison_a_weight()
    assert guard.state_verified()  # step 1 was verified: not checked again at the same step
    assert not guard.state_is_finite() and guard.damaged_ranks == [0]
    assert not guard.state_verified()  # a check that found damage takes the step's verification back


def test_a_nan_in_the_optimizer_state_is_found_too(tmp_path):
    loop = Loop(tmp_path)
    loop.begin()
    loop.step()
    moment = next(iter(loop.optimizer.state.values()))["exp_avg_sq"]
    moment.view(-1)[0] = float("nan")
    assert not loop.guard.state_is_finite()


def test_take_snapshot_copies_the_state_of_this_step(tmp_path):
    loop = Loop(tmp_path)
    loop.begin()
    loop.step()
    assert loop.guard.take_snapshot() is False  # nothing to publish: the host copy is the good state
    snap = loop.guard.snapshotter.snapshot
    assert snap.step == 1 and same(snap.params, trainable(loop.model))
    assert snap.optimizer_state  # the moments exist after the first update, and are held
    kept = {n: t.clone() for n, t in snap.params.items()}
    loop.step()
    assert same(snap.params, kept)  # a copy: training on does not change it


# ---------------------------------------------------------------------------------------------------- recovery
def test_a_damaged_state_is_rolled_back_to_the_snapshot_exactly(tmp_path):
    """A bad update at step 3: the loss stays finite, a weight turns NaN after the optimizer step. The decision is a
    restore from memory (nothing for the caller to load) that goes on (no abort)."""
    loop = Loop(tmp_path, faults={3: "update"})
    loop.begin()
    guard = loop.guard
    loop.step(), loop.step()
    assert loop.boundary(TrainerControl()) is not None  # the snapshot of step 2
    good, good_moments = trainable(loop.model), optimizer_state(loop.optimizer)
    lr = loop.optimizer.param_groups[0]["lr"]
    assert not bool(loop.step())  # step 3's update is applied, then damaged
    assert loop.injected == [(3, "update")]
    decision = loop.inspect(verify=True)
    assert decision.verdict.rollback == "nonfinite_state"
    assert decision.restore and decision.load is None and not decision.abort
    assert same(trainable(loop.model), good)  # the snapshot's weights, bit for bit
    moments = optimizer_state(loop.optimizer)
    assert len(moments) == len(good_moments) and all(torch.equal(a, b) for a, b in zip(moments, good_moments))
    assert loop.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.5)  # `nan_lr_backoff`
    assert loop.port.scheduler.base_lrs == [pytest.approx(lr * 0.5)]  # the schedule's rates with it
    assert loop.global_step == 3  # the timeline never rewinds
    (event,) = guard.events.events
    assert (event.step, event.kind) == (3, "rollback")
    assert event.detail["restored_step"] == 2 and event.detail["discarded_steps"] == [3]
    assert event.detail["reason"] == "nonfinite_state" and "weights_or_optimizer_state" in event.nonfinite
    assert (guard.state.rollbacks, guard.rollbacks_this_run, guard.state.discarded_steps) == (1, 1, 1)
    assert guard.state.lr_scale == 0.5 and guard.verified_step == 3 and guard.flags.pending == []


def test_skips_in_a_row_roll_back(tmp_path):
    loop = Loop(tmp_path, faults={1: "loss", 2: "loss", 3: "loss"}, nan_max_consecutive_skips=3)
    loop.begin()
    snapshot = trainable(loop.model)
    for _ in range(3):
        assert bool(loop.step())
    decision = loop.inspect()
    verdict = decision.verdict
    assert [r.step for r in verdict.skipped] == [1, 2, 3] and verdict.rollback == "consecutive_skips"
    assert verdict.fault_step == 1 and decision.restore and not decision.abort
    assert [e.kind for e in loop.guard.events.events] == ["skip", "skip", "skip", "rollback"]
    assert same(trainable(loop.model), snapshot)


def test_before_publishing_verifies_afresh_what_a_later_callback_may_have_damaged(tmp_path):
    """Before a save or an evaluation the integration layer asks for a fresh verification (`hooks.py`:
    `judge(verify=True, fresh=True)`); with nothing to publish it asks for nothing to be verified."""
    loop = Loop(tmp_path)
    loop.begin()
    guard = loop.guard
    loop.step(), loop.step()
    loop.boundary(TrainerControl())  # verified at step 2, snapshot taken
    good = trainable(loop.model)
    loop.poison_a_weight()  # e.g. a callback after the guard's
    assert loop.inspect() is None  # no save, no evaluation: nothing checked
    assert loop.inspect(verify=True).verdict.rollback is None  # not fresh: step 2's verification is trusted
    assert guard.events.events == []
    decision = loop.inspect(verify=True, fresh=True)
    assert decision.restore and [e.kind for e in guard.events.events] == ["rollback"]
    assert same(trainable(loop.model), good)


def test_finish_puts_back_a_state_damaged_after_the_last_check(tmp_path):
    """`check_at_end` decides what the caller loads (with the memory source and no best checkpoint: nothing)."""
    loop = Loop(tmp_path)
    loop.begin()
    guard = loop.guard
    loop.step(), loop.step()
    loop.boundary(TrainerControl(should_training_stop=True))  # the last check, with a snapshot of step 2
    good = trainable(loop.model)
    assert loop.finish() is None  # healthy: nothing to do
    assert guard.events.events == []
    loop.poison_a_weight()
    end = loop.finish()
    assert end.best is None and end.load is None  # the snapshot in memory
    (event,) = guard.events.events
    assert (event.kind, event.detail["reason"], event.detail["restored_step"]) == (
        "restore", "damaged_after_last_check", 2,
    )  # fmt: skip
    assert same(trainable(loop.model), good) and guard.state.rollbacks == 0  # no backoff, no counter


def test_finish_before_training_began_does_nothing(tmp_path):
    loop = Loop(tmp_path)
    loop.poison_a_weight()
    assert loop.finish() is None  # no snapshot to restore, no check: `train()` failed before `on_train_begin`
    assert loop.guard.events.events == []
