"""The collapse watch on real GRPO runs (tiny model, CPU): a reward function that turns constant at step k gives a
`collapse` event within 10 steps in `nan_events.jsonl` and a timeline marker; a clean run gives none; the watch reads
no tensor (no host sync added to the step)."""

from __future__ import annotations

import pytest
from host_reads import HostReads  # tests/ is on sys.path

from safe_trainers.collapse import SIGNAL_NAMES
from safe_trainers.collapse.watch import CollapseCallback
from safe_trainers.runtime.events import read_events
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.toy import rank_reward
from safe_trainers.timeline.markers import markers

K, STEPS = 8, 16


def reward_turning_constant(box: list):
    """`rank_reward` (different inside every group) until the trainer reaches step `K`, then 1.0 everywhere."""

    def rank_reward_then_constant(completions, **kwargs):
        if box[0].state.global_step >= K:
            return [1.0] * len(completions)
        return rank_reward(completions)

    return rank_reward_then_constant


class WatchedForHostReads:
    """The trainer's collapse watch, its steps run inside [`HostReads`]."""

    def __init__(self, watch):
        self.watch, self.reads = watch, []
        self.metrics = watch.metrics

    def step_end(self, step, metrics):
        with HostReads() as reads:
            out = self.watch.step_end(step, metrics)
        self.reads += reads.reads
        return out


def grpo(toy_models, out, reward, **config):
    return build_trainer(
        "grpo", toy_models["qwen2"], out, max_steps=STEPS, collapse_window=10, trainer_kwargs={"reward_funcs": reward},
        **config,
    )  # fmt: skip


def test_a_reward_turning_constant_is_reported_within_10_steps(toy_models, tmp_path):
    box: list = []
    trainer = grpo(toy_models, tmp_path, reward_turning_constant(box), collapse_signals=list(SIGNAL_NAMES))
    box.append(trainer)
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, CollapseCallback))
    callback.watch = watched = WatchedForHostReads(callback.watch)
    trainer.train()
    events = [e for e in read_events(str(tmp_path)) if e["kind"] == "collapse"]
    assert {e["signal"] for e in events} == {"reward_std", "frac_reward_zero_std"}
    for event in events:
        assert K < event["step"] <= K + 10
        assert event["direction"] in ("down", "up") and event["window"] == K  # the steps before k
    reward_std = next(e for e in events if e["signal"] == "reward_std")
    assert reward_std["value"] == 0.0 and reward_std["median"] > 0 and reward_std["threshold"] > 0
    marks = [m for m in markers(read_events(str(tmp_path))) if m.kind == "collapse"]
    assert len(marks) == 2 and "collapse warning; signal reward_std; `reward_std`" in " ".join(m.text for m in marks)
    assert watched.reads == []  # TRL's metrics are host floats already: the watch adds no sync


@pytest.mark.parametrize("signals", [None, list(SIGNAL_NAMES)], ids=["default", "all"])
def test_a_clean_run_has_no_collapse_event(toy_models, tmp_path, signals):
    config = {} if signals is None else {"collapse_signals": signals}
    trainer = grpo(toy_models, tmp_path, rank_reward, **config)
    assert trainer.safe_run.collapse is not None
    trainer.train()
    assert [e for e in read_events(str(tmp_path)) if e["kind"] == "collapse"] == []
