"""Readers of a checkpoint written in the background that saw it differently from a synchronous save's (found in
review): the upload's label, and a `train()` left by an exception with a save in flight. Each test runs the real SFT
trainer on a tiny toy model, with the writer held mid-checkpoint."""

from __future__ import annotations

import concurrent.futures
import os
import threading

import pytest
import transformers.trainer
import trl
from guard_utils import checkpoint_steps
from transformers import TrainerCallback

import safe_trainers as st
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.held_writes import hold_writes
from safe_trainers.trainer.mixin import SafeTrainerMixin


class _FakeHub:
    """`hf_api()` of transformers' trainer, recording each `upload_folder` (folder, commit message)."""

    def __init__(self):
        self.uploads = []

    def upload_folder(self, **kwargs):
        self.uploads.append((os.path.basename(kwargs["folder_path"]), kwargs["commit_message"]))
        done = concurrent.futures.Future()
        done.set_result(None)
        return done


class _NoRepoSFT(trl.SFTTrainer):
    def init_hf_repo(self, token=None, private=None):
        self.hub_model_id, self.push_in_progress = "local/test", None


class NoRepoSFTTrainer(SafeTrainerMixin, _NoRepoSFT):
    _safety_kind = "sft"
    _safety_config_class = st.SFTConfig
    _trl_class = trl.SFTTrainer


def test_a_checkpoint_uploaded_once_published_is_labelled_with_its_own_step(toy_models, tmp_path, monkeypatch):
    # The stock `_push_from_checkpoint` labels the upload with `state.global_step`: a synchronous save uploads
    # checkpoint-2 as "step 2". Written in the background and announced at step 4, it must still say "step 2".
    hub = _FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    trainer = build_trainer(
        "sft", toy_models["qwen2"], str(tmp_path), preset="guarded", save_in_background=True,
        trainer_cls=NoRepoSFTTrainer, max_steps=4, save_steps=2, push_to_hub=True,
        hub_strategy="all_checkpoints", hub_model_id="local/test",
    )  # fmt: skip
    held = hold_writes(trainer, step=2, on_hold=lambda: threading.Timer(2.0, lambda: held.release()).start())
    trainer.train()
    checkpoints = [(folder, message) for folder, message in hub.uploads if folder.startswith("checkpoint-")]
    assert checkpoints == [
        ("checkpoint-2", "Training in progress, step 2, checkpoint"),
        ("checkpoint-4", "Training in progress, step 4, checkpoint"),
    ]


def test_a_checkpoint_published_before_train_raises_is_announced_to_its_readers(toy_models, tmp_path):
    # checkpoint-4 is written in the background; step 5 raises. The writer finishes and publishes checkpoint-4 (it is
    # on disk and in the step record), as a synchronous save would have: its readers must hear of it too (`on_save`,
    # the rotation down to `save_total_limit=1`), as they would have synchronously before step 5 began.
    out = str(tmp_path)
    trainer = build_trainer("sft", toy_models["qwen2"], out, preset="guarded",
        save_in_background=True, max_steps=8, save_steps=2, save_total_limit=1)  # fmt: skip
    saved = []

    class RaiseAt5(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            saved.append(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                assert held.holding.wait(120)
                held.release()
                raise RuntimeError("boom at step 5")

    trainer.add_callback(RaiseAt5())
    held = hold_writes(trainer, step=4)
    with pytest.raises(RuntimeError, match="boom at step 5"):
        trainer.train()
    assert trainer.safe_run.progress.history.checkpoints[-1] == 4  # published (the step record lists it)
    assert saved == [2, 4]  # `on_save` of the published checkpoint-4
    assert checkpoint_steps(out) == [4]  # rotated to `save_total_limit=1`, as a synchronous save leaves it
