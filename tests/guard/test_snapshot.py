"""`HostSnapshot` (`guard/rollback/memory.py`, a `RollbackSource`): a restore puts back the weights, the optimizer's
moments and step counters and the best-model fields of the step the snapshot was taken at; the learning rate stays as
the schedule left it; frozen parameters are never copied."""

from __future__ import annotations

import types

import pytest
import torch

from safe_trainers.guard.backends import Backend
from safe_trainers.guard.rollback.checkpoint import CheckpointSource
from safe_trainers.runtime.events import EventLog
from safe_trainers.guard.rollback.source import RollbackSource, kept_hyperparameters
from safe_trainers.guard.rollback.memory import HostSnapshot


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)  # frozen, as a LoRA base
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return model, optimizer


def train_step(model, optimizer):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()


def state_of(model, optimizer):
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())}
    return weights, moments


def test_a_restore_puts_back_weights_moments_and_best_fields_but_not_the_learning_rate():
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer)
    snapshotter = HostSnapshot(model, Backend(optimizer, zero_stage=None, loss_scaled=False))
    assert isinstance(snapshotter, RollbackSource)
    best = dict(best_metric=0.5, best_global_step=1, best_model_checkpoint="checkpoint-1")
    trainer_state = types.SimpleNamespace(global_step=1, **best)
    snap = snapshotter.take(trainer_state)
    assert snap.step == 1 and "0.weight" not in snap.params and set(snap.params) == {"0.bias", "1.weight", "1.bias"}
    good = state_of(model, optimizer)
    for _ in range(2):
        train_step(model, optimizer)
    with torch.no_grad():
        model[1].weight.fill_(float("nan"))
    optimizer.param_groups[0]["lr"] = 0.025  # where the schedule is now
    trainer_state.global_step, trainer_state.best_metric = 3, 0.1
    assert snapshotter.restore(trainer_state).step == 1
    weights, moments = state_of(model, optimizer)
    assert all(torch.equal(weights[n], good[0][n]) for n in good[0])
    assert all(torch.equal(moments[i][k], good[1][i][k]) for i in good[1] for k in good[1][i])  # `step` included
    assert trainer_state.best_metric == 0.5 and trainer_state.global_step == 3  # the timeline goes on
    assert optimizer.param_groups[0]["lr"] == 0.025


def test_a_snapshot_before_the_first_step_restores_an_empty_optimizer_state():
    model, optimizer = model_and_optimizer()
    snapshotter = HostSnapshot(model, Backend(optimizer, zero_stage=None, loss_scaled=False))
    snapshotter.take(types.SimpleNamespace(global_step=0))
    train_step(model, optimizer)
    assert optimizer.state
    snapshotter.restore(types.SimpleNamespace(global_step=1))
    assert not optimizer.state  # AdamW starts its moments afresh, as it did then


def test_the_moments_appearing_allocate_only_their_own_buffers():
    # The first snapshot (before the first step) holds the weights; the moments appear at the first step. The next
    # snapshot allocates buffers for them alone: the weights' buffers are kept, not allocated anew with them.
    model, optimizer = model_and_optimizer()
    snapshotter = HostSnapshot(model, Backend(optimizer, zero_stage=None, loss_scaled=False))
    snapshotter.take(types.SimpleNamespace(global_step=0))
    weights = [b.data_ptr() for b in snapshotter.host.buffers.values()]
    moments_before = snapshotter.moments.allocations
    assert snapshotter.host.allocations == 1 and snapshotter.moments.nbytes() == 0
    train_step(model, optimizer)
    snapshotter.take(types.SimpleNamespace(global_step=1))
    assert snapshotter.host.allocations == 1 and snapshotter.moments.allocations == moments_before + 1
    assert [b.data_ptr() for b in snapshotter.host.buffers.values()] == weights
    assert snapshotter.allocation_seconds() == snapshotter.moments.allocation_seconds > 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    moments = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    assert snapshotter.held_bytes() == sum(p.numel() * 4 for p in trainable) + moments
    snapshotter.take(types.SimpleNamespace(global_step=2))  # the layout holds: nothing allocated
    assert snapshotter.host.allocations == 1 and snapshotter.moments.allocations == moments_before + 1
    assert snapshotter.allocation_seconds() == 0.0


def test_nothing_to_restore_before_a_snapshot_is_taken():
    model, optimizer = model_and_optimizer()
    with pytest.raises(RuntimeError, match="has not taken a snapshot yet"):
        HostSnapshot(model, Backend(optimizer, None, False)).restore(types.SimpleNamespace(global_step=0))


def test_both_sources_of_the_last_good_state_are_rollback_sources(tmp_path):
    model, optimizer = model_and_optimizer()
    backend = Backend(optimizer, zero_stage=None, loss_scaled=False)
    on_disk = CheckpointSource(None, backend, EventLog(str(tmp_path), write=False), str(tmp_path))
    for source in (HostSnapshot(model, backend), on_disk):
        assert isinstance(source, RollbackSource) and source.backend is backend


def test_kept_hyperparameters_undo_what_a_load_brings_back():
    _, optimizer = model_and_optimizer()
    state = optimizer.state_dict()
    optimizer.param_groups[0]["lr"] = 0.01
    with kept_hyperparameters(optimizer):
        optimizer.load_state_dict(state)  # brings lr=0.1 back
    assert optimizer.param_groups[0]["lr"] == 0.01
