"""The guard's rollback message tells what happened (issue 23, item 4): a step whose update the guard skipped had no
update to discard, and training goes on with the step after the rollback (or ends there). It used to say "the
updates of steps 9-9 are discarded ... Training goes on from step 9" after step 9 was skipped and logged."""

from __future__ import annotations

import pytest

from safe_trainers.guard import read_events
from safe_trainers.guard.records import discarded_updates
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


@pytest.mark.parametrize(
    "since_snapshot, skipped, words",
    [
        ([9], {9}, "no applied update is discarded (step 9 was skipped)"),  # the demo's step 9
        ([3, 4, 5], {3, 4, 5}, "no applied update is discarded (steps 3-5 were skipped)"),
        ([5, 6, 7], {7}, "the updates of steps 5-6 are discarded (step 7 was skipped), their batches are not "
         "replayed"),
        ([5, 6, 7], {6, 2}, "the updates of steps 5, 7 are discarded (step 6 was skipped), their batches are not "
         "replayed"),
        ([7], set(), "the updates of step 7 are discarded, their batches are not replayed"),
        ([], set(), "no update is discarded (the state was damaged after the step was verified)"),
    ],
)
def test_the_words_for_what_a_restore_threw_away(since_snapshot, skipped, words):
    assert discarded_updates(since_snapshot, skipped) == words


def rollback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("NaN guard: restored")]


@pytest.mark.parametrize("step, last", [(6, False), (10, True)], ids=["mid-run", "last-step"])
def test_a_nan_weight_reads_as_skip_then_restore(toy_models, tmp_path, caplog, step, last):
    # A NaN weight before step `step`: the step's loss is NaN (skipped, not applied), and the state is restored to the
    # snapshot of the step before (one after every step here); nothing applied is thrown away.
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=step, kind="weight")],
        nan_snapshot_steps=1,
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="safe_trainers"):
        trainer.train()
    events = [(e["step"], e["kind"]) for e in read_events(str(tmp_path))]
    assert events == [(step, "skip"), (step, "rollback")]
    [line] = rollback_lines(caplog)
    expected = f"state of step {step - 1} at step {step} (nonfinite_state); no applied update is discarded"
    assert f"{expected} (step {step} was skipped)" in line and "are discarded" not in line, line
    ending = "The run ends with the restored state." if last else f"Training goes on with step {step + 1}."
    assert line.endswith(ending), line
    assert trainer.state.global_step == 10
