"""The guard's skip under an fp16 loss scaler, with a real `torch.amp.GradScaler` on the CPU, and the clean-up after
each step.

accelerate builds no loss scaler on a CPU (its fp16 mixed precision needs an accelerator), so no Trainer here can
drive one: these tests drive a real `GradScaler("cpu")`, a real AdamW (fused and not) and accelerate's own optimizer
wrapper through the guard's step flags, in the Trainer's order (backward, `unscale_` and clipping, the step's flags,
the skip, accelerate's `scaler.step` + `scaler.update`, the clean-up), with a poisoned step (its batches are not
trained: no backward at all) and NaN losses. tests/gpu/test_gpu_loss_scaling.py runs the same through the Trainer on a
GPU.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from safe_trainers.guard.step.skip import route_for
from safe_trainers.guard.step.flags import StepFlags
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


INIT_SCALE = 2.0**10


class ScaledRun:
    """A tiny model trained in the Trainer's order with a real CPU `GradScaler`, the guard's flags deciding the skip
    (`guard=False`: the scaler alone, as stock training drives it)."""

    def __init__(self, fused: bool, guard: bool = True):
        Accelerator(cpu=True)  # accelerate's optimizer wrapper reads the accelerator state
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, fused=fused, foreach=False)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        self.wrapped = AcceleratedOptimizer(self.optimizer, device_placement=False, scaler=self.scaler)
        self.flags = StepFlags(loss_scaled=True) if guard else None
        self.inputs = torch.randn(3, 4)
        self.step = 0

    def train_step(self, kind: str = "clean") -> None:
        """One optimizer step. `kind`: `"clean"`; `"poisoned"` (no forward, no backward: a dropped step);
        `"nan_input"` (a NaN input, so NaN gradients too); `"nan_term"` (a NaN loss with finite gradients: a NaN term
        that does not reach the weights, which only the guard sees)."""
        self.step += 1
        if kind != "poisoned":
            inputs = self.inputs * float("nan") if kind == "nan_input" else self.inputs
            loss = self.model(inputs).square().mean()
            if kind == "nan_term":
                loss = loss + torch.tensor(float("nan"))
            self.scaler.scale(loss).backward()
            if self.flags is not None:
                self.flags.observe_loss(loss)
        self.scaler.unscale_(self.optimizer)  # as accelerate's `clip_grad_norm_` does
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.flags is not None:
            self.flags.end_step(self.step, norm, "cpu", dropped=kind == "poisoned")
            self.flags.skip_update(self.wrapped, self.scaler)
        self.wrapped.step()
        if self.flags is not None:
            self.flags.after_update(self.wrapped)
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, torch.Tensor]:
        """The weights and the optimizer state (moments and step counts), cloned."""
        out = {f"w{i}": p.detach().clone() for i, p in enumerate(self.model.parameters())}
        for i, p in enumerate(self.model.parameters()):
            for key, value in self.optimizer.state.get(p, {}).items():
                out[f"{key}{i}"] = torch.as_tensor(value).clone()
        return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "non-fused"])
def test_without_the_guard_a_poisoned_step_crashes_the_scaler(fused):
    # The control: a step with no backward leaves the scaler no inf check, and it refuses the step.
    run = ScaledRun(fused, guard=False)
    run.train_step()
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        run.train_step("poisoned")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "non-fused"])
@pytest.mark.parametrize("fault", ["poisoned", "nan_input", "nan_term"])
def test_a_faulted_step_is_skipped_through_the_scalers_found_inf(fused, fault):
    run = ScaledRun(fused)
    run.train_step()
    before, scale = run.state(), run.scaler.get_scale()
    run.train_step(fault)
    # Weights, moments and step counts are those of before the step; the scaler counted it as an overflow.
    assert same(run.state(), before)
    assert run.scaler.get_scale() == scale * run.scaler.get_backoff_factor()
    assert "found_inf" not in vars(run.optimizer)
    run.train_step()  # and training goes on: the next clean step applies
    after = run.state()
    assert not torch.equal(after["w0"], before["w0"]) and int(after["step0"]) == int(before["step0"]) + 1
    records = run.flags.read()
    assert [(r.step, r.bad, r.overflow) for r in records] == [(1, False, False), (2, True, False), (3, False, False)]


def test_an_overflow_stays_the_scalers_own():
    # Inf gradients with a finite loss: the scaler skips the step and backs off; the guard records an overflow only.
    run = ScaledRun(fused=True)
    run.train_step()
    before, scale = run.state(), run.scaler.get_scale()
    run.model[0].weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    run.train_step()
    assert same(run.state(), before) and run.scaler.get_scale() == scale * run.scaler.get_backoff_factor()
    assert [(r.bad, r.overflow) for r in run.flags.read()] == [(False, False), (False, True)]


def test_a_step_whose_gradients_were_not_unscaled_yet_is_checked_first():
    # No clipping and no norm before the step (`unscale_` not called): the guard records the scaler's checks itself,
    # so the fold is not overwritten when `GradScaler.step` would have unscaled.
    run = ScaledRun(fused=True)
    run.train_step()
    before = run.state()
    loss = run.model(run.inputs).square().mean() + torch.tensor(float("nan"))
    run.scaler.scale(loss).backward()
    run.flags.observe_loss(loss)
    run.flags.end_step(2, torch.tensor(1.0), "cpu")
    run.flags.skip_update(run.wrapped, run.scaler)
    run.wrapped.step()
    run.flags.after_update(run.wrapped)
    assert same(run.state(), before)


@pytest.mark.parametrize("overflow_elsewhere", [False, True])
def test_a_fault_is_folded_into_one_devices_record_of_a_model_on_two_devices(overflow_elsewhere):
    # A model split over two devices in one process (`device_map`): the scaler keeps a record per device and hands a
    # fused optimizer their sum, which skips only on exactly 1. The guard's fault must not make that sum 2. (Two CPU
    # device names stand for two GPUs: the records are keyed by device.)
    run = ScaledRun(fused=True)
    run.train_step()
    before = run.state()
    loss = run.model(run.inputs).square().mean() + torch.tensor(float("nan"))  # finite gradients, a NaN loss
    run.scaler.scale(loss).backward()
    run.flags.observe_loss(loss)
    run.scaler.unscale_(run.optimizer)
    record = run.scaler._found_inf_per_device(run.optimizer)
    record[torch.device("cpu", 0)] = torch.tensor(float(overflow_elsewhere))  # the second device's own check
    run.flags.end_step(2, torch.tensor(1.0), "cpu")
    run.flags.skip_update(run.wrapped, run.scaler)
    run.wrapped.step()
    run.flags.after_update(run.wrapped)
    assert same(run.state(), before)


@pytest.mark.parametrize(
    "fused,scaler,route",
    [
        (True, "enabled", "scaler"),
        (False, "enabled", "scaler"),
        (True, "disabled", "found_inf"),  # a disabled scaler calls `optimizer.step()` straight away
        (True, None, "found_inf"),
        (False, None, "drop_grads"),
    ],
)
def test_the_skip_route(fused, scaler, route):
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), fused=fused, foreach=False)
    scalers = {"enabled": torch.amp.GradScaler("cpu"), "disabled": torch.amp.GradScaler("cpu", enabled=False)}
    assert route_for(optimizer, scalers.get(scaler)) == route


def test_the_fused_optimizers_found_inf_is_removed_after_the_step(toy_models, tmp_path):
    # The last step is a fault, skipped through the fused optimizer's `found_inf`: nothing of it is left on the
    # optimizer, so a later step outside the guard (and a pickled optimizer) does not carry the skip.
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(10, "loss")])
    trainer.train()
    assert trainer.nan_guard.state.skipped_steps == 1 and trainer.state.global_step == 10
    optimizer = trainer.optimizer.optimizer
    assert optimizer.defaults["fused"] and "found_inf" not in optimizer.__getstate__()
    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    before = param.detach().clone()
    param.grad = torch.ones_like(param)
    for group in optimizer.param_groups:
        group["lr"] = 1e-3  # the schedule ended at 0
    optimizer.step()
    assert not torch.equal(param.detach(), before)
