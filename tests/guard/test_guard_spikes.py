"""The spike detector (`safe_trainers.guard.step.spikes`): a spike in the loss or the gradient norm is skipped before
its update, on the device; skipped steps stay out of the window; the window is saved with checkpoints and a resumed run
continues it. Unit tests feed the detector plain values; the run tests train DPO for real with spikes injected
(`Fault(kind="loss_scale")`, `Fault(kind="grad_scale")`)."""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import replace

import pytest
import torch
from guard_utils import read_json, weights_finite
from hypothesis import given, settings
from hypothesis import strategies as st_
from transformers import TrainerCallback

from safe_trainers.guard import read_events
from safe_trainers.guard.policy import StepReading, diagnosed_step, judge_window, spike_run_rolled_back
from safe_trainers.guard.step.spikes import SpikeSettings, SpikeWindow
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


NAN = float("nan")


def judge(window: SpikeWindow, loss: float, grad_norm: float = 1.0, applied: bool = True) -> bool:
    return bool(window.judge(torch.tensor(loss), torch.tensor(grad_norm), torch.tensor(applied)))


def feed(window: SpikeWindow, values, grad_norm: float = 1.0) -> list[bool]:
    return [judge(window, v, grad_norm) for v in values]


# ---------------------------------------------------------------- the detector, plain values
@pytest.mark.parametrize("center,spread", [(0.69, 0.01), (0.0, 1e-3), (-0.02, 5e-3), (-3.0, 0.2), (1e4, 300.0)])
def test_spikes_are_found_at_any_sign_and_scale(center, spread):
    rng = random.Random(0)
    window = SpikeWindow(SpikeSettings(6.0))
    assert not any(feed(window, [center + rng.gauss(0, spread) for _ in range(40)]))
    assert feed(window, [center + 50 * spread]) == [True]


def test_a_spike_in_the_gradient_norm_alone_counts():
    window = SpikeWindow(SpikeSettings(6.0))
    rng = random.Random(1)
    for _ in range(30):
        judge(window, 0.5 + rng.gauss(0, 0.01), 1.0 + rng.gauss(0, 0.05))
    assert judge(window, 0.5, 50.0)


def test_warmup_counts_entered_steps_and_judges_from_then_on():
    window = SpikeWindow(SpikeSettings(6.0, window=64, warmup=16))
    feed(window, [1.0 + 0.01 * (i % 3) for i in range(15)])
    assert not judge(window, 1000.0) and int(window.count) == 16  # judged by no one: enters the window
    window = SpikeWindow(SpikeSettings(6.0, window=64, warmup=16))
    feed(window, [1.0 + 0.01 * (i % 3) for i in range(16)])
    assert judge(window, 1000.0) and int(window.count) == 16  # judged: a spike, kept out


def test_skipped_and_spiking_steps_never_enter_the_window():
    window = SpikeWindow(SpikeSettings(6.0, window=8, warmup=4))
    feed(window, [1.0, 1.1, 0.9, 1.0, 1.05])
    before = (window.values.clone(), int(window.count))
    assert judge(window, 100.0)  # a spike: skipped, not entered
    assert not judge(window, 100.0, applied=False)  # skipped for another reason (a fault): neither judged nor kept
    assert not judge(window, NAN) and not judge(window, 1.0, grad_norm=float("inf"))
    assert torch.equal(window.values, before[0]) and int(window.count) == before[1]


@settings(max_examples=30, deadline=None)
@given(
    st_.lists(st_.floats(-10, 10, allow_nan=False), min_size=20, max_size=80),
    st_.lists(st_.sampled_from([NAN, float("inf"), float("-inf")]), min_size=1, max_size=5),
)
def test_nonfinite_values_never_enter_the_window(history, poison):
    window = SpikeWindow(SpikeSettings(6.0))
    feed(window, history)
    before = (window.values.clone(), int(window.count))
    for value in poison:
        assert not judge(window, value) and not judge(window, 0.0, grad_norm=value)
    assert torch.equal(window.values, before[0]) and int(window.count) == before[1]


def test_a_history_without_spread_gives_no_verdict():
    # GRPO losses and gradients are exactly 0 while every group has equal rewards: such steps are not kept, and the
    # first informative step is not a spike.
    window = SpikeWindow(SpikeSettings(6.0, warmup=2))
    feed(window, [0.0] * 30, grad_norm=0.0)
    assert int(window.count) == 0 and not judge(window, 0.05, 0.3)


def test_steps_without_a_learning_signal_do_not_feed_the_window():
    # Sparse GRPO rewards: most generations have equal rewards in every group (loss and grad norm exactly 0).
    window = SpikeWindow(SpikeSettings(6.0))
    for step in range(200):
        signal = step % 10 in (0, 1)  # a learning signal on two steps in a row, one generation in five
        value = (0.01 * ((step * 7) % 5 - 2), 0.5 + 0.1 * ((step * 3) % 4)) if signal else (0.0, 0.0)
        assert not judge(window, *value), step


def test_the_history_is_oldest_first_and_a_restored_window_judges_alike():
    rng = random.Random(3)
    values = [(1.0 + rng.gauss(0, 0.05), 2.0 + rng.gauss(0, 0.1)) for _ in range(13)]
    window = SpikeWindow(SpikeSettings(6.0, window=8, warmup=4))
    for loss, norm in values:
        judge(window, loss, norm)
    history = window.history()
    expected = [pytest.approx(v) for v in values[-8:]]
    assert list(zip(history["loss"], history["grad_norm"])) == expected  # the ring wrapped: the last 8, in order
    restored = SpikeWindow(SpikeSettings(6.0, window=8, warmup=4), json.loads(json.dumps(history)))
    probes = [(1.02, 2.05), (5.0, 2.0), (1.0, 9.0), (0.98, 1.9), (1.01, 2.2)]
    assert [judge(restored, *p) for p in probes] == [judge(window, *p) for p in probes] == [
        False, True, True, False, False
    ]  # fmt: skip
    # A smaller window keeps the newest values.
    assert SpikeWindow(SpikeSettings(6.0, window=4, warmup=2), history).history()["loss"] == history["loss"][-4:]


def test_spiking_steps_count_as_skips_and_roll_back_in_a_row():
    def spike(step):
        return StepReading(step, 50.0, 1.0, bad=False, spike=True)

    ok = StepReading(1, 0.5, 1.0, bad=False)
    verdict = judge_window([ok, spike(2), spike(3)], 0, 3)
    assert verdict.rollback is None and verdict.consecutive == 2 and [r.step for r in verdict.spikes] == [2, 3]
    assert verdict.skipped == []  # not faults: no diagnosis, no `skip` events
    assert judge_window([spike(4)], 2, 3).rollback == "consecutive_skips"
    # A run of skips that holds a spike restarts the window; a run of faults alone, or an earlier spike, does not.
    fault = StepReading(5, NAN, 1.0, bad=True)
    assert spike_run_rolled_back(judge_window([spike(4)], 2, 3))
    assert not spike_run_rolled_back(judge_window([spike(2), ok, replace(fault, step=3), replace(fault, step=4),
                                                   fault], 0, 3))  # fmt: skip
    # Only a non-finite fault is diagnosed (the replay that names the first non-finite module); spikes are finite.
    assert diagnosed_step(judge_window([spike(4)], 2, 3)) is None
    assert diagnosed_step(judge_window([spike(3), fault], 1, 3)) == 5
    # Under DeepSpeed the update was applied before the flag existed: a spike then rolls back at once.
    verdict = judge_window([ok, spike(2)], 0, 3, spikes_applied=True)
    assert (verdict.rollback, verdict.fault_step, verdict.consecutive) == ("loss_spike", 2, 0)


def test_step_flags_fold_a_spike_into_the_skip_flag():
    # The hot path: StepFlags judges the step's (agreed) loss and norm and returns the skip flag the optimizer gets.
    from safe_trainers.guard.step.flags import StepFlags

    flags = StepFlags(spikes=SpikeWindow(SpikeSettings(6.0, window=8, warmup=4)))

    def step(number, loss, norm):
        flags.observe_loss(torch.tensor(loss))
        return bool(flags.end_step(number, torch.tensor(norm), "cpu"))

    assert not any(step(i, 0.5 + 0.01 * (i % 3), 1.0 + 0.05 * (i % 2)) for i in range(1, 7))
    assert step(7, 50.0, 1.0) and step(8, NAN, 1.0) and step(9, 0.5, 80.0) and not step(10, 0.51, 1.02)
    records = flags.read()
    assert [(r.step, r.bad, r.spike) for r in records[6:]] == [(7, False, True), (8, True, False), (9, False, True),
                                                               (10, False, False)]  # fmt: skip
    assert int(flags.spikes.count) == 7  # steps 1-6 and 10


# ---------------------------------------------------------------- real runs
class WeightsAtStep(TrainerCallback):
    """A copy of the first trainable weight matrix at the end of every step."""

    def __init__(self, trainer):
        self.param = next(p for n, p in trainer.model.named_parameters() if p.requires_grad and p.dim() == 2)
        self.at: dict[int, torch.Tensor] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.at[state.global_step] = self.param.detach().clone()


def spiky_dpo(toy_models, tmp_path, faults, **overrides):
    # lr 1e-5 (the "quick" preset's): a run as it should be, where the "guarded" preset's 1e-3 makes DPO's gradient
    # norm jump by itself (see docs/guard.md, "Spikes").
    config = dict(
        max_steps=30, learning_rate=1e-5, save_strategy="no", nan_spike_factor=6.0, nan_spike_window=64,
        nan_spike_warmup=16,
    )  # fmt: skip
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=faults, **{**config, **overrides}
    )
    weights = WeightsAtStep(trainer)
    trainer.add_callback(weights)
    return trainer, weights


@pytest.mark.parametrize(
    "fault", [Fault(step=24, kind="loss_scale", value=100.0), Fault(step=24, kind="grad_scale", value=1000.0)]
)
def test_a_spike_is_skipped_before_its_update(toy_models, tmp_path, fault):
    trainer, weights = spiky_dpo(toy_models, tmp_path, [fault])
    trainer.train()
    assert (24, fault.kind) in trainer.fault_injector.injected
    events = read_events(str(tmp_path))
    assert [(e["step"], e["kind"]) for e in events] == [(24, "spike")]
    assert math.isfinite(events[0]["loss"]) and events[0]["grad_norm"] > 0
    assert torch.equal(weights.at[24], weights.at[23]) and not torch.equal(weights.at[25], weights.at[24])
    state = trainer.nan_guard.state
    assert (state.spike_steps, state.skipped_steps, state.rollbacks) == (1, 0, 0)
    assert trainer.state.global_step == 30 and weights_finite(trainer)
    assert trainer.state.log_history[-2]["nan_guard/spike_steps"] == 1


def test_without_detection_the_spike_reaches_the_weights(toy_models, tmp_path):
    # The control of the test above: the same injected spike, spike detection off, is applied.
    trainer, weights = spiky_dpo(toy_models, tmp_path, [Fault(step=24, kind="loss_scale", value=100.0)],
                                 nan_spike_factor=0.0)  # fmt: skip
    trainer.train()
    assert read_events(str(tmp_path)) == [] and not torch.equal(weights.at[24], weights.at[23])


def test_a_healthy_run_has_no_false_skip(toy_models, tmp_path):
    # 60 DPO steps with k=6 past the warm-up: no step is skipped (bench/spike_false_skips.py measures all trainers).
    trainer, _ = spiky_dpo(toy_models, tmp_path, [], max_steps=60)
    trainer.train()
    assert int(trainer.nan_guard.spikes.count) == 60  # every step was judged (after the warm-up) and entered
    assert read_events(str(tmp_path)) == [] and trainer.nan_guard.state.spike_steps == 0


@pytest.mark.parametrize("keep_window", [True, False])
def test_a_resumed_run_continues_the_window(toy_models, tmp_path, keep_window):
    # A spike right after the resume (step 21) is judged against the 20 steps saved with checkpoint-20; with the
    # window taken out of the checkpoint (the control), the detector is in its warm-up and lets it through.
    first, _ = spiky_dpo(toy_models, tmp_path, [], max_steps=20, save_strategy="steps", save_steps=20)
    first.train()
    checkpoint = os.path.join(tmp_path, "checkpoint-20")
    path = os.path.join(checkpoint, "nan_guard_state.json")
    saved = read_json(path)
    assert len(saved["spike_window"]["loss"]) == len(saved["spike_window"]["grad_norm"]) == 20
    assert saved["spike_window"] == first.nan_guard.spikes.history()
    if not keep_window:
        with open(path, "w") as f:
            json.dump({**saved, "spike_window": None}, f)
    resumed, _ = spiky_dpo(toy_models, tmp_path, [Fault(step=21, kind="loss_scale", value=100.0)], max_steps=24)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert (21, "loss_scale") in resumed.fault_injector.injected
    spikes = [e["step"] for e in read_events(str(tmp_path)) if e["kind"] == "spike"]
    assert spikes == ([21] if keep_window else [])
    assert resumed.nan_guard.state.spike_steps == (1 if keep_window else 0)


@pytest.mark.distributed
def test_two_ranks_skip_a_spike_on_one_rank_alike(tmp_path):
    # DDP on two CPU ranks: the loss of rank 1 alone is x100 at step 20; the agreed loss (the largest rank's) spikes
    # on both ranks, so both skip the update and end with the same weights.
    from test_guard_distributed import accelerate_ddp, check_in_sync, launch

    args = ["--max_steps", "22", "--save_steps", "100", "--spike_factor", "6", "--learning_rate", "1e-5"]
    results = launch(accelerate_ddp(), "dpo", ["loss_scale:20:1:100"], tmp_path, *args)
    events = check_in_sync(results, 0, 0, tmp_path / "out")
    assert [(e["step"], e["kind"]) for e in events] == [(20, "spike")]
    assert [r["spikes"] for r in results] == [1, 1] and [20, "loss_scale"] in results[1]["injected"]
    # The event shows the loss that was judged (rank 1's, x100 of DPO's ~log 2), not rank 0's own ordinary loss.
    assert events[0]["loss"] > 10 * math.log(2)
    assert all(r["global_step"] == 22 for r in results)


def test_a_lasting_level_shift_costs_one_rollback_not_the_run(toy_models, tmp_path):
    # From step 25 on every loss (and gradient) is x3 for good: the run's own new level (a new data mix, a reward
    # rescaled), not a spike. Spiking steps never enter the window, so a window of the old level would reject every
    # later step: rollback after rollback until `nan_max_rollbacks`, then `TrainingDivergedError`. The run of spikes
    # rolls back once; the detector then warms up again on the level the run now trains at, and the run finishes.
    trainer, _ = spiky_dpo(toy_models, tmp_path, [Fault(step=25, kind="loss_scale", value=3.0, repeat=1000)],
                           max_steps=60)  # fmt: skip
    trainer.train()
    events = [(e["step"], e["kind"]) for e in read_events(str(tmp_path))]
    assert events == [(25, "spike"), (26, "spike"), (27, "spike"), (27, "rollback")]
    assert trainer.state.global_step == 60 and trainer.nan_guard.state.rollbacks == 1
    assert int(trainer.nan_guard.spikes.count) == 60 - 27  # every step since the rollback entered the new window


def test_one_inspection_records_its_skips_and_spikes_in_step_order(toy_models, tmp_path):
    # A NaN loss at step 21 and a spike at step 22 are read back at the same inspection (the snapshot's, at step 22:
    # no log in between): the event log keeps them in the order they happened, and the skip shows the NaN loss (the
    # spike detector judged it as 0).
    faults = [Fault(step=21, kind="loss"), Fault(step=22, kind="loss_scale", value=100.0)]
    trainer, _ = spiky_dpo(toy_models, tmp_path, faults, max_steps=24, logging_steps=50)
    trainer.train()
    events = read_events(str(tmp_path))
    assert [(e["step"], e["kind"]) for e in events] == [(21, "skip"), (22, "spike")]
    assert events[0]["loss"] == "nan" and events[1]["loss"] > 10 * math.log(2)


def test_a_run_of_spikes_leaves_the_nan_diagnosis_to_a_nan(toy_models, tmp_path):
    # Two spikes in a row (steps 23-24, read back together) roll back: nothing non-finite to localize, so no replay,
    # and the one-time diagnosis is still there for the NaN loss of step 30.
    faults = [Fault(step=23, kind="loss_scale", value=100.0, repeat=2), Fault(step=30, kind="loss")]
    trainer, _ = spiky_dpo(toy_models, tmp_path, faults, max_steps=32, logging_steps=50, nan_max_consecutive_skips=2)
    trainer.train()
    events = {(e["step"], e["kind"]): e for e in read_events(str(tmp_path))}
    assert list(events) == [(23, "spike"), (24, "spike"), (24, "rollback"), (30, "skip")]
    assert "first_nonfinite_module" not in events[24, "rollback"]
    assert events[30, "skip"]["first_nonfinite_module"]["module"] == "model.layers.1"
