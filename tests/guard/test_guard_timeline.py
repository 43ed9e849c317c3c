"""The guard's seams with the Trainer's bookkeeping: run length, final model, resume, best model, logs, loss scaler,
spike detection, diagnosis, event logs, memory, integrations, GRPO rollouts. Real training on CPU, faults injected.

Each test names the item of issue 7 it covers.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import trl
from guard_utils import (
    checkpoint_steps,
    nonfinite_in_checkpoints,
    read_json,
    recording,
    weights_finite,
)

import safe_trainers as st
from safe_trainers.errors import NonFiniteWeightsError
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events
from safe_trainers.mixin import SafeTrainerMixin
from safe_trainers.testing.toy import dataset_for


def final_lr(trainer) -> float:
    return trainer.lr_scheduler.get_last_lr()[0]


# ---------------------------------------------------------------- 1. runs end where they would without faults
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


# ---------------------------------------------------------------- 2. non-finite weights never leave the trainer
def test_damage_by_the_last_update_is_restored_before_the_end(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=10, kind="update")]
    )
    trainer.train()
    events = read_events(str(tmp_path))
    assert [(e["step"], e["kind"], e["reason"]) for e in events] == [(10, "rollback", "nonfinite_state")]
    assert weights_finite(trainer)
    trainer.save_model(str(tmp_path / "final"))  # what TRL's scripts do right after train()
    assert not nonfinite_in_checkpoints(str(tmp_path))


def test_save_model_refuses_nonfinite_weights(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=2, save_strategy="no")
    trainer.train()
    with torch.no_grad():
        next(p for p in trainer.model.parameters() if p.requires_grad).view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match="Refusing to save non-finite weights") as error:
        trainer.save_model(str(tmp_path / "final"))
    assert isinstance(error.value, RuntimeError) and error.value.tensors
    assert not os.path.exists(tmp_path / "final" / "model.safetensors")


# ---------------------------------------------------------------- 3. resume continues the batch stream
@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_resume_after_rollback_continues_the_batch_stream(toy_models, tmp_path, kind):
    faults = [Fault(step=3, kind="weight")]  # rollback at step 3, before checkpoint-4
    cls = recording(st.DPOTrainer if kind == "dpo" else st.GRPOTrainer)
    reference = build_trainer(
        kind, toy_models["qwen2"], tmp_path / "ref", preset="guarded", faults=faults, trainer_cls=cls, max_steps=8
    )
    reference.train()
    # GRPO verifies the weights before sampling step 3's completions: a rollback before any NaN loss.
    expected = ["rollback"] if kind == "grpo" else ["skip", "rollback"]
    assert [e["kind"] for e in read_events(str(tmp_path / "ref"))] == expected
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ref" / "checkpoint-4", resumed_dir / "checkpoint-4")
    resumed = build_trainer(
        kind, toy_models["qwen2"], str(resumed_dir), preset="guarded", faults=faults, trainer_cls=cls, max_steps=8
    )
    resumed.train(resume_from_checkpoint=str(resumed_dir / "checkpoint-4"))
    assert resumed.seen == [s for s in reference.seen if s[0] > 4]  # no batch twice, none lost
    assert resumed.state.global_step == 8 and resumed.nan_guard.state.rollbacks == 1  # counters came back


# ---------------------------------------------------------------- 4. best-model bookkeeping
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


# ---------------------------------------------------------------- 5. fp16 loss-scaler overflows are not faults
class _ScaledDPO(trl.DPOTrainer):
    init_scale = 2.0**120

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=self.init_scale, growth_interval=1000)


class ScaledDPOTrainer(SafeTrainerMixin, _ScaledDPO):
    _safety_kind = "dpo"
    _safety_config_class = st.DPOConfig
    _trl_class = trl.DPOTrainer


def test_loss_scaler_overflows_are_not_faults(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path / "safe", preset="guarded", trainer_cls=ScaledDPOTrainer
    )
    trainer.train()
    events = read_events(str(tmp_path / "safe"))
    overflows = [e["step"] for e in events if e["kind"] == "overflow"]
    assert overflows and {e["kind"] for e in events} == {"overflow"}  # no skip, no rollback
    assert trainer.nan_guard.state.overflow_steps == len(overflows) and trainer.nan_guard.state.rollbacks == 0
    assert trainer.state.log_history[-2]["nan_guard/overflow_steps"] == len(overflows)
    # The scaler calibrates exactly as in stock TRL given the same scaler.
    stock_config = st.DPOConfig(**{**trainer.args.to_dict(), "output_dir": str(tmp_path / "stock")})
    stock = _ScaledDPO(
        toy_models["qwen2"],
        args=trl.DPOConfig(
            **{
                k: getattr(stock_config, k)
                for k in (
                    "output_dir",
                    "max_steps",
                    "per_device_train_batch_size",
                    "learning_rate",
                    "logging_steps",
                    "report_to",
                    "use_cpu",
                    "seed",
                    "save_strategy",
                )
            }
        ),
        train_dataset=trainer.train_dataset,
    )
    stock.train()
    assert stock.accelerator.scaler.get_scale() == trainer.accelerator.scaler.get_scale()
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path / "safe"))


class UnitScaleDPOTrainer(ScaledDPOTrainer):
    init_scale = 1.0  # a scaler that no longer scales: nothing it skips is an overflow it can fix


def test_nonfinite_gradients_at_unit_loss_scale_are_faults(toy_models, tmp_path):
    fault = Fault(step=3, kind="grad", value=float("inf"), repeat=3)
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[fault], trainer_cls=UnitScaleDPOTrainer
    )
    trainer.train()
    events = [(e["step"], e["kind"]) for e in read_events(str(tmp_path))]
    assert events == [(3, "skip"), (4, "skip"), (5, "skip"), (5, "rollback")]
    assert trainer.nan_guard.state.overflow_steps == 0 and weights_finite(trainer)


# ---------------------------------------------------------------- 6. spike detection on a healthy GRPO run
def test_spike_detection_leaves_a_healthy_grpo_run_alone(toy_models, tmp_path):
    trainer = build_trainer(
        "grpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        max_steps=40,
        nan_spike_factor=6.0,
        save_strategy="no",
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert min(losses) < 0 or max(abs(x) for x in losses) < 0.05  # GRPO losses: near 0 and of either sign
    assert not read_events(str(tmp_path)) and trainer.state.global_step == 40


# ---------------------------------------------------------------- 7. abort: backed-off LR saved, resume works
def test_abort_checkpoint_holds_the_backed_off_lr_and_resumes(toy_models, tmp_path):
    fault = Fault(step=3, kind="loss", repeat=3)  # steps 3-5: three skips in a row, no rollback allowed
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[fault], nan_max_rollbacks=0
    )
    with pytest.raises(st.TrainingDivergedError) as error:
        trainer.train()
    checkpoint = error.value.checkpoint_dir
    assert checkpoint.endswith("checkpoint-5")
    optimizer = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=False)
    scheduler = torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=False)
    assert scheduler["base_lrs"] == [pytest.approx(0.5e-3)] * len(scheduler["base_lrs"])
    for group in optimizer["param_groups"]:
        assert group["lr"] == pytest.approx(0.5e-3 * (1 - 5 / 10))  # linear decay after step 5
    assert read_json(os.path.join(checkpoint, "nan_guard_state.json"))["lr_scale"] == 0.5
    # Resume as the message says: continues at the backed-off rate, to the end.
    resumed = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded")
    resumed.train(resume_from_checkpoint=checkpoint)
    lrs = {h["step"]: h["learning_rate"] for h in resumed.state.log_history if "learning_rate" in h}
    assert lrs[6] == pytest.approx(0.5e-3 * (1 - 5 / 10)) and resumed.state.global_step == 10
    # A lower learning rate passed at resume applies too (times the backoff).
    again = build_trainer("dpo", toy_models["qwen2"], tmp_path / "again", preset="guarded", learning_rate=1e-4)
    again.train(resume_from_checkpoint=checkpoint)
    lrs = {h["step"]: h["learning_rate"] for h in again.state.log_history if "learning_rate" in h}
    assert lrs[6] == pytest.approx(0.5e-4 * (1 - 5 / 10))


# ---------------------------------------------------------------- 8. logs never invent a value
def test_logs_report_applied_steps_and_never_rewind(toy_models, tmp_path):
    faults = [Fault(step=4, kind="weight"), Fault(step=9, kind="loss")]
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        faults=faults,
        logging_steps=4,
        include_num_input_tokens_seen="all",
    )
    output = trainer.train()
    history = trainer.state.log_history
    losses = {h["step"]: h["loss"] for h in history if "loss" in h}
    assert sorted(losses) == [4, 8]  # steps 9-10 (with the skipped step 9) are only in `train_loss`
    assert all(math.isfinite(v) and v != 0.0 for v in losses.values())  # step 4 skipped, still a real mean
    steps = [h["step"] for h in history if "loss" in h]
    assert steps == sorted(set(steps))  # no step number logged twice
    tokens = [h["num_input_tokens_seen"] for h in history if "num_input_tokens_seen" in h]
    assert tokens == sorted(tokens) and trainer.state.num_input_tokens_seen == max(tokens)  # never rewound
    assert math.isfinite(output.training_loss) and output.training_loss == history[-1]["train_loss"]


# ---------------------------------------------------------------- 9. diagnosis with gradient accumulation
def test_diagnosis_finds_the_faulty_micro_batch(toy_models, tmp_path):
    fault = Fault(step=3, kind="loss", micro_batch=1)
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[fault], gradient_accumulation_steps=2
    )
    trainer.train()
    skip = read_events(str(tmp_path))[0]
    assert skip["kind"] == "skip" and skip["first_nonfinite_module"]["micro_batch"] == 1
    assert skip["first_nonfinite_module"]["module"].endswith("layers.1")


# ---------------------------------------------------------------- 10. one event log per run
def test_a_new_run_starts_its_own_event_log(toy_models, tmp_path):
    build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=3, kind="loss")], max_steps=4
    ).train()
    second = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=4)
    second.train()
    assert read_events(str(tmp_path)) == []
    kept = read_events_file(tmp_path / "nan_events.previous-1.jsonl")
    assert [e["kind"] for e in kept] == ["skip"]
    resumed = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=6, kind="loss")], max_steps=8
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert [e["step"] for e in read_events(str(tmp_path))] == [6]  # appended to the resumed run's (empty) log
    assert not os.path.exists(tmp_path / "nan_events.previous-2.jsonl")


def read_events_file(path):
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------- 11. memory held for diagnosis
def test_guard_keeps_only_host_copies_of_the_uninspected_steps(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        max_steps=3,
        logging_steps=100,
        nan_snapshot_steps=100,
        save_strategy="no",
        gradient_accumulation_steps=2,
    )
    held = []
    trainer.add_callback(
        type(
            "Probe",
            (trl.trainer.callbacks.TrainerCallback,),
            {
                "on_step_end": lambda self, args, state, control, **kw: held.append(
                    (len(trainer.nan_guard.batches._steps), trainer.nan_guard.batches.nbytes())
                )
            },
        )()
    )
    trainer.train()
    # Steps 1-2 accumulate (no inspection due); the last step is inspected, which drops them.
    assert [n for n, _ in held[:2]] == [1, 2] and held[1][1] > 0
    assert all(
        t.device.type == "cpu"
        for b in trainer.nan_guard.batches._steps.values()
        for x in b
        for t in x.values()
        if torch.is_tensor(t)
    )
    assert trainer.nan_guard.batches.nbytes() == 0


# ---------------------------------------------------------------- 12. integrations only see published checkpoints
class _RecordingPushDPO(trl.DPOTrainer):
    pushed: list

    def init_hf_repo(self, token=None, private=None):
        self.pushed = []

    def _push_from_checkpoint(self, checkpoint_folder):
        self.pushed.append((checkpoint_folder, os.path.isfile(os.path.join(checkpoint_folder, "trainer_state.json"))))


class RecordingPushDPOTrainer(SafeTrainerMixin, _RecordingPushDPO):
    _safety_kind = "dpo"
    _safety_config_class = st.DPOConfig
    _trl_class = trl.DPOTrainer


def test_on_save_and_hub_uploads_see_published_checkpoints(toy_models, tmp_path):
    saved = []

    class OnSave(trl.trainer.callbacks.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            saved.append((state.global_step, os.path.isfile(os.path.join(path, "trainer_state.json"))))

    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        faults=[Fault(step=4, kind="update")],
        trainer_cls=RecordingPushDPOTrainer,
        push_to_hub=True,
        hub_strategy="all_checkpoints",
        hub_model_id="local/test",
    )
    trainer.add_callback(OnSave())
    trainer.train()
    assert saved == [(4, True), (8, True), (10, True)]
    assert [(os.path.basename(f), ok) for f, ok in trainer.pushed] == [
        ("checkpoint-4", True),
        ("checkpoint-8", True),
        ("checkpoint-10", True),
    ]
    assert all(".safe_trainers_staging" not in f for f, _ in trainer.pushed)


# ---------------------------------------------------------------- 13. GRPO: buffered rollouts after a rollback
class _CountingGRPO(st.GRPOTrainer):
    def _generate_and_score_completions(self, inputs):
        self.generated_at = getattr(self, "generated_at", [])
        self.generated_at.append(self.state.global_step + 1)
        return super()._generate_and_score_completions(inputs)


def test_grpo_rollback_discards_rollouts_of_the_discarded_policy(toy_models, tmp_path):
    # One generation serves two steps (`steps_per_generation=2`): generations at steps 1, 3, 5, 7. A bad update at
    # step 7, found by the state check before the save at step 7, rolls back to step 4's snapshot, so the rollouts
    # generated at step 7 for step 8 come from a discarded policy: step 8 must generate afresh from the restored one.
    kwargs = dict(steps_per_generation=2, max_steps=8, nan_snapshot_steps=4, save_steps=7)
    faults = [Fault(step=7, kind="update")]
    trainer = build_trainer(
        "grpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=faults, trainer_cls=_CountingGRPO, **kwargs
    )
    trainer.train()
    assert [(e["kind"], e["restored_step"]) for e in read_events(str(tmp_path))] == [("rollback", 4)]
    assert trainer.generated_at == [1, 3, 5, 7, 8]
    assert weights_finite(trainer) and trainer.state.global_step == 8


def test_discard_rollouts_forces_a_vllm_weight_sync(toy_models, tmp_path):
    trainer = build_trainer("grpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=1)
    trainer._buffered_inputs, trainer._last_loaded_step = [{"x": 1}], 5
    trainer.discard_rollouts()
    assert trainer._buffered_inputs is None and trainer._last_loaded_step == -1


def test_grpo_never_samples_from_a_damaged_policy(toy_models, tmp_path):
    # A NaN weight present when a generation is due would make `torch.multinomial` crash on NaN probabilities
    # ("probability tensor contains either inf, nan or element < 0"): the state is verified before sampling.
    trainer = build_trainer(
        "grpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=3, kind="weight")], max_steps=5
    )
    trainer.train()
    events = read_events(str(tmp_path))
    assert [(e["kind"], e["reason"]) for e in events] == [("rollback", "nonfinite_state")]
    assert weights_finite(trainer) and trainer.state.global_step == 5
