"""`memory.snapshot_fits` and `memory.save_copy_fits`: the NaN guard rolls back from disk when its host copy would not fit in
host memory, and saves are written synchronously when a background save's copy would not fit beside it."""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest

from safe_trainers.arguments import SafetyArguments
from safe_trainers.guard import read_events
from safe_trainers.guard.rollback.source import rollback_source
from safe_trainers.rules.snapshot_size import RunShape, per_node_bytes
from safe_trainers.rules.memory import HOST_MEMORY_SHARE, SaveCopyFits, SnapshotFits
from safe_trainers.rules.report import Change, Finding
from safe_trainers.rules.stages import built_view
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault

RULE = SnapshotFits()
GIB = 2**30


@pytest.fixture
def trainer(toy_models, tmp_path):
    return build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(7, "weight")])


def test_the_view_measures_this_runs_snapshot(trainer):
    view = built_view(trainer)
    params = sum(p.numel() for p in trainer.model.parameters())
    # One process, a full fine-tune in fp32: the weights and AdamW's two fp32 moments.
    assert view.snapshot_strategy == "single"
    assert view.snapshot_bytes_per_node == per_node_bytes(RunShape("dpo", params, params, "single")) == 12 * params
    assert view.host_memory_available > 0


@pytest.mark.parametrize("share,fixed", [(HOST_MEMORY_SHARE * 0.99, False), (HOST_MEMORY_SHARE * 1.01, True)])
def test_switches_to_the_checkpoint_only_when_the_copy_would_not_fit(trainer, share, fixed):
    view = built_view(trainer)
    tight = dataclasses.replace(view, host_memory_available=int(view.snapshot_bytes_per_node / share))
    finding = RULE.check_built(tight)
    assert (finding is not None) is fixed
    if fixed:
        assert finding.action == "fixed"
        assert [(c.path, c.old, c.new) for c in finding.changes] == [
            ("safety_settings.nan_rollback_from", "memory", "checkpoint")
        ]
        assert "GiB per node" in finding.message and "memory.snapshot_fits" in finding.message


def test_the_fix_makes_the_guard_roll_back_from_the_checkpoint(trainer, tmp_path, caplog):
    view = built_view(trainer)
    finding = RULE.check_built(dataclasses.replace(view, host_memory_available=view.snapshot_bytes_per_node))
    RULE.apply_built(trainer, finding)
    trainer.safety_report.findings.append(finding)  # as `run_built_rules` records it
    assert trainer.args.nan_rollback_from == "memory"  # the user's config is not touched
    with caplog.at_level(logging.WARNING, logger="safe_trainers"):
        trainer.train()
    # The guard says which source it uses, that the config says otherwise, and which rule decided.
    assert trainer.nan_guard.rollback_from == "checkpoint"
    said = [r.getMessage() for r in caplog.records if "NaN guard: rolls back from checkpoint" in r.getMessage()]
    assert len(said) == 1 and "`memory.snapshot_fits` rule" in said[0] and "`nan_rollback_from='memory'`" in said[0]
    rollback = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    assert [e["restored_step"] for e in rollback] == [4]  # the checkpoint, not the step-6 host copy
    assert trainer.nan_guard.snapshotter.snapshot.params == {}


def test_the_guard_agrees_with_the_config_or_says_where_it_differs():
    settings = SafetyArguments(nan_rollback_from="checkpoint")
    configured = types.SimpleNamespace(nan_rollback_from="checkpoint")
    assert rollback_source(settings, configured) == ("checkpoint", None)  # they agree: nothing to say
    changed = types.SimpleNamespace(nan_rollback_from="memory")
    source, note = rollback_source(settings, changed)
    assert source == "checkpoint" and "set by the guard's settings" in note and "'memory'" in note
    fixed = Finding(RULE.id, "fixed", "...", (Change("safety_settings.nan_rollback_from", "memory", "checkpoint"),))
    other = Finding("optim.grad_clip", "fixed", "...", (Change("args.max_grad_norm", 0.0, 1.0),))
    report = types.SimpleNamespace(findings=[fixed, other])
    assert "set by the `memory.snapshot_fits` rule" in rollback_source(settings, changed, report)[1]


@pytest.mark.parametrize("overrides", [{"nan_guard": False}, {"nan_rollback_from": "checkpoint"}])
def test_nothing_to_do_without_a_host_copy(trainer, overrides):
    view = built_view(trainer)
    args = dataclasses.replace(trainer.args, **overrides)
    assert RULE.check_built(dataclasses.replace(view, args=args, host_memory_available=1)) is None


def test_a_typical_full_fine_tune_under_ddp_holds_one_copy_per_node():
    # 7B full fine-tune on 8 GPUs of one node under DDP: the ranks share one copy out (78 GiB a node, not 626), so it
    # fits in half of a 256 GiB node and keeps its host copy.
    need = per_node_bytes(RunShape("7B full", 7_000_000_000, 7_000_000_000, "ddp", world_size=8))
    assert 78 < need / GIB < 79 and need <= HOST_MEMORY_SHARE * 256 * GIB


# ---------------------------------------------------------------------------------------------------------------------
# `memory.save_copy_fits`: background saves only where their host copy fits beside the snapshot
# ---------------------------------------------------------------------------------------------------------------------
SAVE_RULE = SaveCopyFits()


def test_the_view_measures_a_background_saves_copy(trainer):
    view = built_view(trainer)
    params = sum(p.numel() for p in trainer.model.parameters())
    assert view.save_copy_bytes == 12 * params  # every fp32 weight and AdamW's two fp32 moments


@pytest.mark.parametrize("share,fixed", [(HOST_MEMORY_SHARE * 0.99, False), (HOST_MEMORY_SHARE * 1.01, True)])
def test_saves_turn_synchronous_only_when_the_copy_and_the_snapshot_would_not_fit(trainer, share, fixed):
    view = built_view(trainer)
    both = view.save_copy_bytes + view.snapshot_bytes_per_node
    finding = SAVE_RULE.check_built(dataclasses.replace(view, host_memory_available=int(both / share)))
    assert (finding is not None) is fixed
    if fixed:
        assert [(c.path, c.old, c.new) for c in finding.changes] == [
            ("safety_settings.save_in_background", True, False)
        ]
        assert "snapshot" in finding.message and "memory.save_copy_fits" in finding.message


def test_no_finding_without_background_saves_or_checkpoints(trainer):
    view = built_view(trainer)
    tight = dataclasses.replace(view, host_memory_available=1)
    assert SAVE_RULE.check_built(tight) is not None
    for config in ({"save_in_background": False}, {"save_strategy": "no"}):
        args = dataclasses.replace(trainer.args, **config)
        assert SAVE_RULE.check_built(dataclasses.replace(tight, args=args)) is None
    assert SAVE_RULE.check_built(dataclasses.replace(tight, save_copy_bytes=None)) is None  # several processes


def test_the_fix_makes_every_save_synchronous(trainer):
    view = built_view(trainer)
    finding = SAVE_RULE.check_built(dataclasses.replace(view, host_memory_available=view.save_copy_bytes))
    SAVE_RULE.apply_built(trainer, finding)
    assert trainer.args.save_in_background is True  # the user's config is not touched
    assert trainer.safety_settings.save_in_background is False
