"""The NaN guard on each of the six trainers, single process: faults injected at chosen steps, real training.

SFT and RLOO train in fp32 (`bf16=False`): bf16 autocast is about three times slower on a CPU, and what the guard does
does not depend on the dtype (the other four train in bf16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from guard_utils import bad_reward_at_step, checkpoint_steps, nonfinite_in_checkpoints, weights_finite

import safe_trainers as st
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events


KINDS = ["sft", "reward", "dpo", "kto", "grpo", "rloo"]
FP32_KINDS = {"sft", "rloo"}


def model_for(toy_models, kind):
    return toy_models["qwen2-rm" if kind == "reward" else "qwen2"]


def guarded(kind, toy_models, tmp_path, faults=(), **overrides):
    """The fault matrix's trainer: the `"guarded"` preset on the kind's toy model (fp32 for SFT and RLOO)."""
    if kind in FP32_KINDS:
        overrides.setdefault("bf16", False)
    return build_trainer(
        kind, model_for(toy_models, kind), tmp_path, preset="guarded", faults=list(faults), **overrides
    )


@pytest.mark.parametrize("kind", KINDS)
def test_nan_loss_is_skipped(toy_models, tmp_path, kind):
    trainer = guarded(kind, toy_models, tmp_path, [Fault(step=6, kind="loss")])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    events = read_events(str(tmp_path))
    assert [(e["step"], e["kind"]) for e in events] == [(6, "skip")]
    assert "loss" in events[0]["nonfinite"]
    assert events[0]["first_nonfinite_module"]["module"].endswith("layers.1")  # where the fault was injected
    assert trainer.state.global_step == 10 and weights_finite(trainer)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())  # it did train
    assert trainer.nan_guard.state.skipped_steps == 1 and trainer.nan_guard.state.rollbacks == 0
    logged = [h for h in trainer.state.log_history if h.get("step") == 6 and "loss" in h]
    assert logged and logged[0]["loss"] != logged[0]["loss"]  # the NaN is visible in the logs, not hidden
    assert trainer.state.log_history[-2]["nan_guard/skipped_steps"] == 1
    assert checkpoint_steps(str(tmp_path)) == [4, 8, 10] and not nonfinite_in_checkpoints(str(tmp_path))


@pytest.mark.parametrize("kind", KINDS)
def test_inf_gradient_is_skipped(toy_models, tmp_path, kind):
    trainer = guarded(kind, toy_models, tmp_path, [Fault(step=5, kind="grad", value=float("inf"))])
    trainer.train()
    events = read_events(str(tmp_path))
    assert [(e["step"], e["kind"], e["nonfinite"]) for e in events] == [(5, "skip", ["grad_norm"])]
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))


@pytest.mark.parametrize("kind", KINDS)
def test_nan_weight_rolls_back(toy_models, tmp_path, kind):
    trainer = guarded(kind, toy_models, tmp_path, [Fault(step=7, kind="weight")])
    trainer.train()
    events = read_events(str(tmp_path))
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["restored_step"] == 6
    assert rollbacks[0]["learning_rate"] < 1e-3  # backed off
    assert "weights_or_optimizer_state" in rollbacks[0]["nonfinite"]
    assert trainer.state.global_step == 10 and weights_finite(trainer)
    assert not nonfinite_in_checkpoints(str(tmp_path))


@pytest.mark.parametrize("kind", ["reward", "dpo"])
def test_lora_nan_loss_and_nan_adapter_weight(toy_models, tmp_path, kind):
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS" if kind == "reward" else None)
    faults = [Fault(step=3, kind="loss"), Fault(step=7, kind="weight")]  # the weight is a LoRA matrix here
    trainer = build_trainer(
        kind,
        model_for(toy_models, kind),
        tmp_path,
        preset="guarded",
        faults=faults,
        trainer_kwargs={"peft_config": lora},
    )
    trainer.train()
    events = [(e["step"], e["kind"]) for e in read_events(str(tmp_path))]
    assert events == [(3, "skip"), (7, "skip"), (7, "rollback")]
    assert weights_finite(trainer) and trainer.state.global_step == 10
    assert not nonfinite_in_checkpoints(str(tmp_path))  # adapter_model.safetensors included


@pytest.mark.parametrize("kind", KINDS)
def test_persistent_fault_aborts_with_last_good_checkpoint(toy_models, tmp_path, kind):
    fault = Fault(step=3, kind="loss", repeat=1000)
    trainer = guarded(kind, toy_models, tmp_path, [fault], nan_max_rollbacks=2, max_steps=20)
    with pytest.raises(st.TrainingDivergedError, match="nan_max_rollbacks=2") as error:
        trainer.train()
    assert isinstance(error.value, RuntimeError)
    # Steps 3-5 and 6-8 are skipped runs (two rollbacks to step 2); the third run (9-11) aborts at step 11. The
    # timeline does not rewind: the abort checkpoint is checkpoint-11, holding step 2's weights.
    checkpoint = error.value.checkpoint_dir
    assert checkpoint and checkpoint.endswith("checkpoint-11") and os.path.isdir(checkpoint)
    assert error.value.report_path and checkpoint in str(error.value) and error.value.report_path in str(error.value)
    assert f"resume_from_checkpoint={checkpoint!r}" in str(error.value)
    events = read_events(str(tmp_path))
    kinds = [e["kind"] for e in events]
    assert kinds.count("rollback") == 2 and kinds[-1] == "abort"
    first = next(e for e in events if e["kind"] == "rollback")
    assert (first["step"], first["restored_step"], first["discarded_steps"]) == (5, 2, [3, 4, 5])
    assert events[-1]["restored_step"] == 2 and events[-1]["step"] == 11
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))


@pytest.mark.parametrize(
    "value,first_only,unscorable,expect_skip",
    [
        (None, False, True, False),  # whole groups unscorable: TRL zeroes their advantages, nothing reaches the loss
        (float("nan"), True, False, False),  # one NaN reward: TRL's nan-aware statistics absorb it
        (float("inf"), True, False, False),  # one Inf reward: TRL 1.16 zeroes the non-finite advantages too
    ],
)
def test_grpo_nonfinite_rewards(toy_models, tmp_path, value, first_only, unscorable, expect_skip):
    reward = bad_reward_at_step(4, value, first_only)
    trainer = build_trainer(
        "grpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=6, trainer_kwargs={"reward_funcs": reward}
    )
    trainer.train()
    events = read_events(str(tmp_path))
    reward_events = [e for e in events if e["kind"] == "reward"]
    assert [e["step"] for e in reward_events] == [4]
    assert (reward_events[0]["unscorable_groups"] > 0) == unscorable
    assert any(e["kind"] == "skip" and e["step"] == 4 for e in events) == expect_skip
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))


class NanAdvantageGRPO(st.GRPOTrainer):
    """Advantages that come back NaN at step 4, as a custom advantage estimator might produce."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.state.global_step + 1 == 4:
            output["advantages"] = output["advantages"] * float("nan")
        return output


def test_grpo_nan_advantages_are_skipped(toy_models, tmp_path):
    trainer = build_trainer(
        "grpo", toy_models["qwen2"], tmp_path, preset="guarded", trainer_cls=NanAdvantageGRPO, max_steps=6
    )
    trainer.train()
    assert [(e["step"], e["kind"]) for e in read_events(str(tmp_path))] == [(4, "skip")]
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))


def test_guard_off_behaves_like_trl(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=3, kind="loss")], nan_guard=False
    )
    trainer.train()
    assert trainer.nan_guard is None and not read_events(str(tmp_path))
    assert not weights_finite(trainer)  # stock behaviour: the NaN update reaches the weights


def test_nonfinite_checkpoint_is_refused(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=2, save_steps=1)
    trainer.train()
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("nan")
    trainer.state.global_step = 3
    trainer._save_checkpoint(trainer.model_wrapped, trial=None)
    assert checkpoint_steps(str(tmp_path)) == [1, 2]
    assert read_events(str(tmp_path))[-1]["kind"] == "save_refused"


def test_save_total_limit_keeps_clean_checkpoints(toy_models, tmp_path):
    fault = Fault(step=3, kind="loss", repeat=1000)
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        preset="guarded",
        faults=[fault],
        save_steps=1,
        save_total_limit=1,
        nan_max_rollbacks=1,
    )
    with pytest.raises(st.TrainingDivergedError) as error:
        trainer.train()
    # Steps 3-5: rollback to step 2; steps 6-8: abort, saving the restored state as checkpoint-8, the newest.
    assert error.value.checkpoint_dir.endswith("checkpoint-8")
    assert checkpoint_steps(str(tmp_path)) == [8]
    assert not nonfinite_in_checkpoints(str(tmp_path))


KILL_SCRIPT = r"""
import os, signal, sys
sys.path.insert(0, {tests!r})
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault

class Killer:
    def __init__(self, trainer):
        original = trainer._save_optimizer_and_scheduler
        def save(output_dir):
            if trainer.state.global_step == 4:
                os.kill(os.getpid(), signal.SIGKILL)  # dies halfway through writing checkpoint-4
            return original(output_dir)
        trainer._save_optimizer_and_scheduler = save

trainer = build_trainer(
    "dpo", {model!r}, {out!r}, preset="guarded", faults=[Fault(step=1, kind="loss")], save_steps=2, max_steps=6
)
Killer(trainer)
trainer.train()
"""


def test_kill_during_save_leaves_previous_checkpoint_loadable(toy_models, tmp_path):
    tests = os.path.dirname(os.path.dirname(__file__))
    script = KILL_SCRIPT.format(tests=tests, model=toy_models["qwen2"], out=str(tmp_path))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(tests))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    assert checkpoint_steps(str(tmp_path)) == [2]  # checkpoint-4 was never published
    assert os.listdir(os.path.join(str(tmp_path), ".safe_trainers_staging")) == ["checkpoint-4"]
    with open(os.path.join(str(tmp_path), "checkpoint-2", "nan_guard_state.json")) as f:
        assert json.load(f)["skipped_steps"] == 1
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(os.path.join(str(tmp_path), "checkpoint-2"))  # loadable

    # Resume: the half-written checkpoint is cleaned up and the guard's counters come back.
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", save_steps=2, max_steps=6)
    trainer.train(resume_from_checkpoint=True)
    assert not os.path.exists(os.path.join(str(tmp_path), ".safe_trainers_staging"))
    assert trainer.nan_guard.state.skipped_steps == 1 and trainer.state.global_step == 6
    assert checkpoint_steps(str(tmp_path)) == [2, 4, 6] and not nonfinite_in_checkpoints(str(tmp_path))
