"""Review of the collapse watch: what it reads of TRL's metrics when the guard's diagnosis replay puts back a copy of
them (`trainer/replay.py`)."""

from __future__ import annotations

import copy

from safe_trainers.arguments import SafetyArguments
from safe_trainers.collapse import SIGNAL_NAMES
from safe_trainers.collapse.watch import CollapseWatch, StepMetrics
from safe_trainers.runtime.events import read_events
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


def test_a_replay_restoring_a_copy_of_the_metrics_does_not_read_earlier_steps_again():
    """The diagnosis replay restores `trainer._metrics` as a deep copy taken before it (new list objects, same
    values): the values of the steps already judged since the last log must not be judged again."""
    metrics: dict = {"train": {"entropy": [5.0]}}
    taken = StepMetrics()
    assert taken.take(metrics["train"], ["entropy"]) == {"entropy": 5.0}  # step 1 (logging_steps > 1: no clear)
    metrics["train"]["entropy"].append(1.0)  # step 2's value; then a NaN step's diagnosis replay:
    metrics = copy.deepcopy(metrics)  # `diagnose` puts back what it saved
    assert taken.take(metrics["train"], ["entropy"]) == {"entropy": 1.0}  # step 2 alone, not mean(5, 1)
    metrics["train"]["entropy"].append(2.0)
    assert taken.take(metrics["train"], ["entropy"]) == {"entropy": 2.0}
    taken.logged()  # a log: TRL clears, the next list is a new one read whole
    metrics["train"].clear()
    metrics["train"]["entropy"] = [4.0, 6.0]
    assert taken.take(metrics["train"], ["entropy"]) == {"entropy": 5.0}


def test_a_nan_steps_diagnosis_replay_leaves_the_judged_values_per_step(toy_models, tmp_path):
    """A real GRPO run logging every 4 steps, a NaN loss at step 3 (the guard's diagnosis replays it, then puts back
    a copy of TRL's metrics): the reward judged at each step is that step's own (the reward is the step number)."""
    box: list = []

    def step_reward(completions, **kwargs):
        return [float(box[0].state.global_step + 1)] * len(completions)  # during step s, `global_step` is s - 1

    trainer = build_trainer(
        "grpo", toy_models["qwen2"], tmp_path, max_steps=4, logging_steps=4, collapse_signals=["reward"],
        collapse_window=8, faults=[Fault(step=3, kind="loss")], trainer_kwargs={"reward_funcs": step_reward},
    )  # fmt: skip
    box.append(trainer)
    trainer.train()
    assert trainer.nan_guard.state.skipped_steps == 1  # the fault hit (and was diagnosed)
    assert list(trainer.safe_run.collapse.states[0].window) == [1.0, 2.0, 3.0, 4.0]


def test_a_signal_named_twice_is_watched_once():
    """`collapse_signals=["entropy", "entropy"]` made two states reading the same value: two events per collapse."""
    assert SafetyArguments(collapse_signals="entropy, entropy,kl").collapse_signals == ["entropy", "kl"]
    watch = CollapseWatch(["entropy", "entropy"], window=8, patience=2)
    for step, value in enumerate([3.0] * 8 + [0.1] * 4, start=1):
        watch.step_end(step, {"entropy": [value]})
        watch.metrics.logged()
    assert watch.episodes == [(10, "entropy")]


def six_words_or_more(completions, **kwargs):
    """A sparse 0/1 reward (like a correctness check): 1 for a completion of 6 words or more."""
    return [float(len(str(c).split()) >= 6) for c in completions]


def test_a_clean_run_with_a_sparse_binary_reward_does_not_alarm(toy_models, tmp_path):
    """Clean GRPO, 8 completions of up to 16 tokens (one group per step), lr 1e-3, every signal watched: the step's
    only group is all 0 by chance on many steps (`reward_std` 0, `frac_reward_zero_std` 1), in runs of up to 5 here,
    which patience alone (3) took for a collapse (found in review: episodes at steps 22 and 71 of 150). The streak a
    collapse needs grows with how often the run's own recent values cross (`needed_streak`): no episode."""
    trainer = build_trainer(
        "grpo", toy_models["qwen2"], tmp_path, max_steps=30, seed=0, num_generations=8, per_device_train_batch_size=8,
        max_completion_length=16, learning_rate=1e-3, lr_scheduler_type="constant", collapse_signals=list(SIGNAL_NAMES),
        logging_steps=1, trainer_kwargs={"reward_funcs": six_words_or_more},
    )  # fmt: skip
    trainer.train()
    zero_std = "".join("0" if log.get("reward_std") == 0 else "1" for log in trainer.state.log_history[:-1])
    assert max(len(run) for run in zero_std.split("1")) > 3  # the chance streaks are there
    assert [e for e in read_events(str(tmp_path)) if e["kind"] == "collapse"] == []


def test_a_generation_spanning_two_steps_is_judged_once_at_the_step_that_generated(toy_models, tmp_path):
    """`steps_per_generation=2`, logging every 3 steps (TRL's clear falls between generations): the reward (the step
    number of its generation) is judged at steps 1, 3, 5 only, each value once; entropy at every step."""
    box: list = []

    def step_reward(completions, **kwargs):
        return [float(box[0].state.global_step + 1)] * len(completions)

    trainer = build_trainer(
        "grpo", toy_models["qwen2"], tmp_path, max_steps=6, logging_steps=3, steps_per_generation=2,
        collapse_signals=["reward", "entropy"], collapse_window=8, trainer_kwargs={"reward_funcs": step_reward},
    )  # fmt: skip
    box.append(trainer)
    trainer.train()
    reward, entropy = trainer.safe_run.collapse.states
    assert list(reward.window) == [1.0, 3.0, 5.0] and len(entropy.window) == 6


def test_evaluation_metrics_never_enter_the_train_judgment(toy_models, tmp_path):
    """Evaluation every 2 steps, logging every 3: the reward of evaluation's completions (100) is never judged."""
    box: list = []

    def step_reward(completions, **kwargs):
        return [float(box[0].state.global_step + 1) if box[0].model.training else 100.0] * len(completions)

    trainer = build_trainer(
        "grpo", toy_models["qwen2"], tmp_path, max_steps=6, logging_steps=3, eval_rows=4, eval_strategy="steps",
        eval_steps=2, collapse_signals=["reward"], collapse_window=8, trainer_kwargs={"reward_funcs": step_reward},
    )  # fmt: skip
    box.append(trainer)
    trainer.train()
    assert any("eval_reward" in log for log in trainer.state.log_history)  # evaluation ran, and generated
    assert list(trainer.safe_run.collapse.states[0].window) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
