"""Integrations (`on_save` callbacks, Hub uploads) only see published checkpoints. Real training on CPU, faults
injected.
"""

from __future__ import annotations

import os

import trl

import safe_trainers as st
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.trainer.mixin import SafeTrainerMixin


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
