"""Runs with a rollback end where they would without faults: at `max_steps`, or after the last epoch with its save and
evaluation. Real training on CPU, faults injected.
"""

from __future__ import annotations

from guard_utils import checkpoint_steps, nonfinite_in_checkpoints

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events
from safe_trainers.testing.toy import dataset_for


def final_lr(trainer) -> float:
    return trainer.lr_scheduler.get_last_lr()[0]


def test_rollback_on_the_last_step_still_ends_at_max_steps(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=10, kind="weight")]
    )
    trainer.train()
    rollback = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    assert [(e["step"], e["restored_step"]) for e in rollback] == [(10, 8)]
    assert trainer.state.global_step == trainer.state.max_steps == 10
    assert final_lr(trainer) == 0.0  # the linear schedule ran to its end
    assert checkpoint_steps(str(tmp_path)) == [4, 8, 10] and not nonfinite_in_checkpoints(str(tmp_path))


def test_epoch_based_run_with_rollback_ends_with_save_and_eval(toy_models, tmp_path):
    data = dataset_for("dpo", 24)
    settings = dict(max_steps=-1, num_train_epochs=1, save_strategy="epoch", eval_strategy="epoch")
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        dataset=data,
        faults=[Fault(step=5, kind="weight")],
        trainer_kwargs={"eval_dataset": dataset_for("dpo", 4)},
        **settings,
    )
    trainer.train()
    assert [e["kind"] for e in read_events(str(tmp_path))] == ["skip", "rollback"]
    assert trainer.state.max_steps == 12 and trainer.state.global_step == 12
    assert final_lr(trainer) == 0.0
    assert checkpoint_steps(str(tmp_path)) == [12]  # the end-of-epoch save happened
    assert any("eval_loss" in h and h["step"] == 12 for h in trainer.state.log_history)  # and the eval
