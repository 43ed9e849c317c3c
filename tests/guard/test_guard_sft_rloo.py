"""The NaN guard on SFT and RLOO, single process: the fault matrix of `test_guard.py` (NaN loss, Inf gradient, NaN
weight, persistent fault), RLOO's non-finite rewards, and RLOO's buffered rollouts after a rollback.

These runs train in fp32 (`bf16=False`): bf16 autocast is about three times slower on a CPU, and what the guard does
does not depend on the dtype (`test_guard.py` runs the same faults in bf16 on the other four trainers).
"""

from __future__ import annotations

import os

import pytest
import torch
from guard_utils import (
    bad_reward_at_step,
    checkpoint_steps,
    guarded_trainer,
    nonfinite_in_checkpoints,
    weights_finite,
)

import safe_trainers as st
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events


KINDS = ["sft", "rloo"]


def guarded(kind, toy_models, tmp_path, faults=(), **overrides):
    return guarded_trainer(kind, toy_models["qwen2"], str(tmp_path), list(faults), bf16=False, **overrides)


@pytest.mark.parametrize("kind", KINDS)
def test_nan_loss_is_skipped(kind, toy_models, tmp_path):
    trainer = guarded(kind, toy_models, tmp_path, [Fault(step=6, kind="loss")])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    events = read_events(str(tmp_path))
    assert [(e["step"], e["kind"]) for e in events] == [(6, "skip")]
    assert "loss" in events[0]["nonfinite"]
    assert events[0]["first_nonfinite_module"]["module"].endswith("layers.1")  # where the fault was injected
    assert trainer.state.global_step == 10 and weights_finite(trainer)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())  # it did train
    logged = [h for h in trainer.state.log_history if h.get("step") == 6 and "loss" in h]
    assert logged and logged[0]["loss"] != logged[0]["loss"]  # the NaN is visible in the logs
    assert checkpoint_steps(str(tmp_path)) == [4, 8, 10] and not nonfinite_in_checkpoints(str(tmp_path))


@pytest.mark.parametrize("kind", KINDS)
def test_inf_gradient_is_skipped(kind, toy_models, tmp_path):
    trainer = guarded(kind, toy_models, tmp_path, [Fault(step=5, kind="grad", value=float("inf"))])
    trainer.train()
    events = read_events(str(tmp_path))
    assert [(e["step"], e["kind"], e["nonfinite"]) for e in events] == [(5, "skip", ["grad_norm"])]
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))


@pytest.mark.parametrize("kind", KINDS)
def test_nan_weight_rolls_back(kind, toy_models, tmp_path):
    trainer = guarded(kind, toy_models, tmp_path, [Fault(step=7, kind="weight")])
    trainer.train()
    rollbacks = [e for e in read_events(str(tmp_path)) if e["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["restored_step"] == 6
    assert rollbacks[0]["learning_rate"] < 1e-3  # backed off
    assert "weights_or_optimizer_state" in rollbacks[0]["nonfinite"]
    assert trainer.state.global_step == 10 and weights_finite(trainer)
    assert not nonfinite_in_checkpoints(str(tmp_path))


@pytest.mark.parametrize("kind", KINDS)
def test_persistent_fault_aborts_with_last_good_checkpoint(kind, toy_models, tmp_path):
    fault = Fault(step=3, kind="loss", repeat=1000)
    trainer = guarded(kind, toy_models, tmp_path, [fault], nan_max_rollbacks=2, max_steps=20)
    with pytest.raises(st.TrainingDivergedError, match="nan_max_rollbacks=2") as error:
        trainer.train()
    # Skips 3-5 and 6-8 roll back to step 2; the third run (9-11) aborts: checkpoint-11 holds step 2's weights.
    checkpoint = error.value.checkpoint_dir
    assert checkpoint and checkpoint.endswith("checkpoint-11") and os.path.isdir(checkpoint)
    kinds = [e["kind"] for e in read_events(str(tmp_path))]
    assert kinds.count("rollback") == 2 and kinds[-1] == "abort"
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))


@pytest.mark.parametrize(
    "value,first_only,unscorable,expect_skip",
    [
        (None, False, True, False),  # a whole group unscorable: TRL zeroes its advantages
        (float("nan"), True, False, False),  # one NaN reward: left out of the leave-one-out baseline, advantage 0
        # One Inf reward: the other completions' baselines are Inf, and TRL's `nan_to_num` turns their advantages into
        # -3.4e38 (GRPO zeroes them instead). The loss stays finite, its gradient is not: the step is skipped.
        (float("inf"), True, False, True),
    ],
)
def test_rloo_nonfinite_rewards(toy_models, tmp_path, value, first_only, unscorable, expect_skip):
    reward = bad_reward_at_step(4, value, first_only)
    trainer = guarded("rloo", toy_models, tmp_path, reward_funcs=reward, max_steps=6)
    trainer.train()
    events = read_events(str(tmp_path))
    reward_events = [e for e in events if e["kind"] == "reward"]
    assert [e["step"] for e in reward_events] == [4]
    assert (reward_events[0]["unscorable_groups"] > 0) == unscorable
    assert [(e["step"], e["nonfinite"]) for e in events if e["kind"] == "skip"] == (
        [(4, ["grad_norm"])] if expect_skip else []
    )
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(tmp_path))


class CountingRLOO(st.RLOOTrainer):
    """Counts the generation rounds (each fills the rollout buffer)."""

    def _generate_and_score_completions(self, inputs):
        self.generation_rounds = getattr(self, "generation_rounds", 0) + 1
        return super()._generate_and_score_completions(inputs)


def test_rloo_discard_rollouts_regenerates_from_the_current_policy(toy_models, tmp_path):
    # One generation round serves two optimizer steps (`steps_per_generation=2`); after a rollback the guard calls
    # `discard_rollouts()`, and the next micro-batch must be generated again rather than taken from the buffer.
    trainer = guarded("rloo", toy_models, tmp_path, trainer_cls=CountingRLOO, max_steps=1, steps_per_generation=2)
    trainer.train()
    assert trainer.generation_rounds == 1 and trainer._buffered_inputs is not None
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    trainer._prepare_inputs(batch)  # step 1 of 2: served from the buffer
    assert trainer.generation_rounds == 1
    trainer.discard_rollouts()
    assert trainer._buffered_inputs is None
    trainer._prepare_inputs(batch)
    assert trainer.generation_rounds == 2
