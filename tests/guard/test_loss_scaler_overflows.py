"""fp16 loss-scaler overflows are the scaler's own calibration, not faults; non-finite gradients at unit scale are.
Real training on CPU, faults injected.
"""

from __future__ import annotations

import torch
import trl
from guard_utils import nonfinite_in_checkpoints, weights_finite

import safe_trainers as st
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events
from safe_trainers.trainer.mixin import SafeTrainerMixin


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
