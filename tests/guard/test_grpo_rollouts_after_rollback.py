"""GRPO after a rollback: the buffered rollouts of the discarded policy are dropped, vLLM's weights are synced, and no
completion is sampled from a damaged policy. Real training on CPU, faults injected.
"""

from __future__ import annotations

from guard_utils import weights_finite

import safe_trainers as st
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events


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
