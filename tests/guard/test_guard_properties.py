"""Property-based fault schedules: whatever the faults, the guard keeps the Trainer's contracts.

Hypothesis draws a schedule (NaN loss, Inf gradient, NaN weight the loss sees, NaN weight left by an update that the
loss does not see; at random steps, 1-3 repeats) and the run's intervals (gradient accumulation, logging, saving,
evaluation, snapshots, fixed or adaptive), trains a real trainer on CPU, resumes from one of its checkpoints in a fresh
directory, and checks on every example:

* the run ends at `max_steps` (or aborts with a saved, finite last good state);
* the final model and `save_model`'s output are finite, and so is `train_loss`;
* every checkpoint is finite, loadable and consistent (`global_step`, published best-model path, guard state);
* resuming from the checkpoint trains exactly the batches the uninterrupted run trained after it;
* the output directory holds one event log, this run's.

Default (CI): 2 derandomized examples per trainer. More: `python -m pytest --hypothesis-profile=long
tests/guard/test_guard_properties.py`.
"""

from __future__ import annotations

import glob
import math
import os
import shutil

import pytest
from guard_utils import fault_schedules, nonfinite_in_checkpoints, read_json, recording, weights_finite
from hypothesis import given
from hypothesis import strategies as st_
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import safe_trainers as st
from safe_trainers.guard import read_events
from safe_trainers.testing.build import build_trainer
from safe_trainers.trainers import trainer_class

MAX_STEPS = 8
faults = fault_schedules(MAX_STEPS, max_repeat=3, values=(float("nan"), float("inf")))
intervals = st_.fixed_dictionaries(
    {
        "gradient_accumulation_steps": st_.sampled_from([1, 2]),
        "logging_steps": st_.sampled_from([1, 3]),
        "save_steps": st_.sampled_from([2, 3]),
        "nan_snapshot_steps": st_.sampled_from([2, 3, None]),  # None: unset (10, or adapting from 1)
        # 0: a fixed interval; 1e-9: no snapshot fits, the interval stretches to `save_steps` once measured; 0.9:
        # every snapshot fits, it shrinks to the lower bound (every step when unset)
        "nan_snapshot_budget": st_.sampled_from([0.0, 1e-9, 0.9]),
        "evaluate": st_.booleans(),
    }
)


def run(kind, model, out, schedule, settings, resume=None):
    settings = dict(settings)
    evaluate = settings.pop("evaluate") and kind != "grpo"  # GRPO evaluation generates: too slow for this test
    if evaluate:
        settings.update(eval_strategy="steps", eval_steps=settings["save_steps"], metric_for_best_model="eval_loss")
    trainer = build_trainer(
        kind,
        model,
        out,
        preset="guarded",
        faults=schedule,
        trainer_cls=recording(trainer_class(kind)),
        max_steps=MAX_STEPS,
        eval_rows=4 if evaluate else 0,
        **settings,
    )
    try:
        output = trainer.train(resume_from_checkpoint=resume)
    except st.TrainingDivergedError as error:
        return trainer, None, error
    return trainer, output, None


def check_checkpoint(path: str, kind: str) -> None:
    step = int(path.rsplit("-", 1)[1])
    state = read_json(os.path.join(path, "trainer_state.json"))
    assert state["global_step"] == step
    with open(os.path.join(path, "trainer_state.json")) as f:
        assert ".safe_trainers_staging" not in f.read()
    best = state["best_model_checkpoint"]
    assert best is None or os.path.isdir(best) or int(best.rsplit("-", 1)[1]) < step  # rotated away is allowed
    if best is not None:
        evals = {h["step"]: h["eval_loss"] for h in state["log_history"] if "eval_loss" in h}
        assert state["best_metric"] == evals[int(best.rsplit("-", 1)[1])]
    assert os.path.isfile(os.path.join(path, "nan_guard_state.json"))
    auto = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    auto.from_pretrained(path)  # loadable


@pytest.mark.parametrize("kind", ["reward", "dpo", "kto", "grpo"])
@given(schedule=faults, settings=intervals, data=st_.data())
def test_fault_schedules_keep_the_trainer_contracts(toy_models, tmp_path_factory, kind, schedule, settings, data):
    model = toy_models["qwen2-rm" if kind == "reward" else "qwen2"]
    root = tmp_path_factory.mktemp(kind)
    out = str(root / "run")
    trainer, output, error = run(kind, model, out, schedule, settings)

    if error is None:
        assert trainer.state.global_step == MAX_STEPS
        assert math.isfinite(output.training_loss)
        assert weights_finite(trainer)
        trainer.save_model(str(root / "final"))
    else:
        assert error.checkpoint_dir and os.path.isdir(error.checkpoint_dir)
    assert not nonfinite_in_checkpoints(str(root))
    published = sorted(glob.glob(os.path.join(out, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
    for path in published:
        check_checkpoint(path, kind)
    assert [os.path.basename(p) for p in glob.glob(os.path.join(out, "nan_events*.jsonl"))] in (
        [],
        ["nan_events.jsonl"],
    )
    assert len(read_events(out)) == len(trainer.nan_guard.events.events)

    # Resuming from a checkpoint at `max_steps` trains one more step in stock transformers: not a resume to compare.
    published = [p for p in published if int(p.rsplit("-", 1)[1]) < MAX_STEPS]
    if not published:
        return
    checkpoint = data.draw(st_.sampled_from(published), label="resume from")
    step = int(checkpoint.rsplit("-", 1)[1])
    resumed_dir = root / "resumed"
    shutil.copytree(checkpoint, resumed_dir / os.path.basename(checkpoint))
    again, _, _ = run(
        kind, model, str(resumed_dir), schedule, settings, resume=str(resumed_dir / os.path.basename(checkpoint))
    )
    after = [s for s in trainer.seen if s[0] > step]
    if error is None:
        assert getattr(again, "seen", []) == after
        assert again.state.global_step == MAX_STEPS
    else:  # the resumed run has its own rollback budget, so it may go further than the aborted one
        assert getattr(again, "seen", [])[: len(after)] == after
