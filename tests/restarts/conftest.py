"""Fixtures shared by the restarts tests."""

from __future__ import annotations

import pytest
from guard_utils import recording

from safe_trainers.testing.build import build_trainer
from safe_trainers.trainers import trainer_class


@pytest.fixture(scope="module")
def finished_run(toy_models, tmp_path_factory):
    """A real guarded DPO run in `out/` with checkpoints at steps 2 and 4, and the micro-batches it trained on (one
    per test module; tests copy it before they change it)."""
    out = str(tmp_path_factory.mktemp("finished") / "out")
    trainer = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=4, save_steps=2,
                            trainer_cls=recording(trainer_class("dpo")))  # fmt: skip
    trainer.train()
    return out, trainer.seen
