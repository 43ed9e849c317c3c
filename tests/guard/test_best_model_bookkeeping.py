"""The best-model bookkeeping (`best_model_checkpoint`, `best_metric`) follows the kept timeline, published and across
resume. Real training on CPU, faults injected.
"""

from __future__ import annotations

import math
import os

from guard_utils import checkpoint_steps, read_json

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


def test_best_model_paths_are_published_and_survive_resume(toy_models, tmp_path):
    kwargs = dict(
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        max_steps=8,
    )
    faults = [Fault(step=5, kind="update")]
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=faults, eval_rows=4, **kwargs
    )
    trainer.train()
    for step in checkpoint_steps(str(tmp_path)):
        state = read_json(str(tmp_path / f"checkpoint-{step}" / "trainer_state.json"))
        best = state["best_model_checkpoint"]
        assert best is None or ".safe_trainers_staging" not in best, best
        # Published when written; an older checkpoint may name a best that rotation removed after a newer best.
        assert best is None or os.path.isdir(best) or int(best.rsplit("-", 1)[1]) < step
        evals = {h["step"]: h["eval_loss"] for h in state["log_history"] if "eval_loss" in h}
        if best is not None:
            assert state["best_metric"] == evals[int(best.rsplit("-", 1)[1])]
    assert trainer.state.best_model_checkpoint and os.path.isdir(trainer.state.best_model_checkpoint)
    # Resuming keeps the best checkpoint (transformers drops one that does not exist).
    resumed = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", eval_rows=4, **{**kwargs, "max_steps": 10}
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.best_model_checkpoint and os.path.isdir(resumed.state.best_model_checkpoint)


def test_rollback_restores_best_metric_of_the_kept_timeline(toy_models, tmp_path):
    # Evaluation every step, save every 4: the rollback at step 7 goes back to step 6's snapshot; evaluations of
    # the discarded step 7 must not stay "best".
    kwargs = dict(eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss", max_steps=8)
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        faults=[Fault(step=7, kind="update")],
        eval_rows=4,
        **kwargs,
    )
    trainer.train()
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    # Step 7's evaluation ran on the restored weights (the state is verified before every evaluation).
    assert all(math.isfinite(v) for v in evals.values())
    assert trainer.state.best_metric == min(evals.values())
