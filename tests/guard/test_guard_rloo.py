"""The NaN guard on RLOO's own paths, single process: non-finite rewards, and the buffered rollouts after a rollback.
(The fault matrix, NaN loss, Inf gradient, NaN weight and persistent fault, runs over all six kinds in
`test_faults_on_each_trainer.py`.)
In fp32, like the matrix's RLOO runs.
"""

from __future__ import annotations

import pytest
from guard_utils import (
    bad_reward_at_step,
    nonfinite_in_checkpoints,
    weights_finite,
)

import safe_trainers as st
from safe_trainers.guard import read_events
from safe_trainers.testing.build import build_trainer


def guarded(kind, toy_models, tmp_path, faults=(), **overrides):
    return build_trainer(
        kind, toy_models["qwen2"], tmp_path, preset="guarded", faults=list(faults), bf16=False, **overrides
    )


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
    trainer = guarded("rloo", toy_models, tmp_path, max_steps=6, trainer_kwargs={"reward_funcs": reward})
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
