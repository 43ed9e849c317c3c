"""What the NaN guard needs from trainers that generate their own training data (GRPO, RLOO).

These trainers sample their own training data from the policy, score it with reward functions, and buffer one
generation batch for several optimizer steps (`steps_per_generation`, `num_iterations`). The guard:

* verifies the weights before each generation: sampling from a damaged policy either crashes (`torch.multinomial`
  on NaN probabilities) or fills the buffer with garbage, so a damaged state is rolled back first;
* records non-finite rewards, and keeps the last generation's for a replay bundle (docs/replay.md);
* after a rollback, discards the buffered rollouts: they were sampled, and their `old_per_token_logps` computed, by
  the policy it just threw away.
"""

from __future__ import annotations

import torch

from ..guard import record_rewards
from . import inspection


class OnlineGenerationMixin:
    """Mixed in before TRL's `GRPOTrainer`/`RLOOTrainer` (after [`SafeTrainerMixin`])."""

    replay_rewards: torch.Tensor | None = None  # the last generation's rewards (completions x reward functions)

    def _generate_and_score_completions(self, inputs):
        run = self.safe_run
        if run.guard is not None:
            run.hooks_ran.ran("_generate_and_score_completions")  # see `hooks_ran.py`
        if run.guard is not None and self.model.training:
            # Judge the pending steps and verify the state now (not from the cache: generation is far costlier than
            # the check), rolling back a damaged state before it samples.
            inspection.inspect(self, verify=True, fresh=True)
        return super()._generate_and_score_completions(inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL turns a `None` reward into NaN and zeroes the advantage of a completion no reward function scored; an
        # Inf reward would reach the loss (and is then skipped by the guard). Either way, record it.
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        run = self.safe_run
        if run.guard is not None:
            run.hooks_ran.ran("_calculate_rewards")
        if run.guard is not None and self.model.training and run.guard.bundles_on:
            self.replay_rewards = rewards.detach()  # for a replay bundle of the steps trained on them (no copy here)
        if run.guard is not None and self.model.training:
            nonfinite = ~torch.isfinite(rewards)
            count = int(nonfinite.sum())  # TRL already reads its reward metrics back every generation
            if count:
                unscorable = nonfinite.all(dim=1).view(-1, self.num_generations).all(dim=1)
                step = self.state.global_step + 1
                record_rewards(run.events, step, count, rewards.shape[0], int(unscorable.sum()))
        return rewards

    def discard_rollouts(self) -> None:
        """Drop the buffered generation batch and force the next generation to push the weights to vLLM again.

        Called after the guard restored an older policy (`inspection.carry_out`): the next micro-batch regenerates
        completions (and their old log-probabilities) from the restored weights, for the same prompts.
        """
        self._buffered_inputs = None
        if hasattr(self, "_last_loaded_step"):
            self._last_loaded_step = -1  # TRL re-syncs vLLM only when `global_step` differs from this
