"""Benchmark: the collapse watch's false alarms on clean GRPO/RLOO runs, and its delay on injected collapses, per
signal, to choose `collapse_signals`' default by measurement (`docs/collapse.md`).

Workloads, on the tiny local model (CPU): the shipped configs (`configs/trainers/grpo.yaml`, `rloo.yaml`: 8
completions of up to 128 tokens, the `length` reward, lr 1e-6 constant after a 5% warm-up, `beta` 0 and 0.05) and the
trainers' tests' presets (`"quick"`: lr 1e-5, 2 completions of 8 tokens, `rank_reward`; `"guarded"`: lr 1e-3, 2
completions of 6 tokens, `count_words_reward`), and a run that learns (`-learning`: 8 completions of up to 16 tokens,
a word-count reward, lr 1e-3 constant: the others barely move the tiny random model) and the same with a sparse 0/1
reward (`-sparse`: 1 for 6 words or more, one group per step). Every signal is watched
(`collapse_signals` = all of them):

1. clean runs of `--steps` steps, `--seeds` seeds each: every `collapse` event is a false alarm;
2. injected collapses from step `--inject-at` (k): the learning rate x100 from step k (the scheduler's base rates
   scaled), or every reward function turning constant (1.0) for the completions generated after step k; the delay
   of each signal is the step of its first `collapse` event minus k ("-": none within `--after` steps).

    python bench/collapse_alarms.py --series runs.json               # every workload; the runs' logs kept
    python bench/collapse_alarms.py --workloads grpo-quick --steps 60 --seeds 1
    python bench/collapse_alarms.py --replay runs.json other.json     # the tables again, from kept logs

`--replay` judges the kept per-step logs (`logging_steps=1`) with the watch as it is now, one step at a time: exact,
since the watch never changes training and these workloads generate and train one micro-batch per step, so a step's
logged metric is the value the watch reads. It is how a threshold change is measured without training again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import PrinterCallback, TrainerCallback  # noqa: E402
from workload import markdown_table, quiet  # noqa: E402

from safe_trainers.collapse import SIGNAL_NAMES, SIGNALS  # noqa: E402
from safe_trainers.runtime.events import read_events  # noqa: E402
from safe_trainers.scripts.rewards import length  # noqa: E402
from safe_trainers.testing.build import PRESETS, build_trainer  # noqa: E402
from safe_trainers.testing.toy import save_toy_model  # noqa: E402

# The shipped configs' training fields (their model and dataset replaced by the toy ones; fp32 on the CPU).
SHIPPED = dict(
    num_generations=8, max_completion_length=128, temperature=1.0, per_device_train_batch_size=8,
    gradient_accumulation_steps=1, learning_rate=1e-6, lr_scheduler_type="constant_with_warmup", warmup_steps=0.05,
    max_grad_norm=1.0, use_cpu=True,
)  # fmt: skip
# A run that learns (the other workloads barely move the tiny random model): 8 completions of up to 16 tokens, a
# reward with a spread inside every group that the policy can climb (more words), lr 1e-3 constant.
LEARNING = dict(
    num_generations=8, per_device_train_batch_size=8, max_completion_length=16, learning_rate=1e-3,
    lr_scheduler_type="constant", use_cpu=True,
)  # fmt: skip


def word_count(completions, **kwargs) -> list[float]:
    """The number of words of each completion (a reward a tiny model can climb)."""
    return [float(len(str(c).split())) for c in completions]


def six_words_or_more(completions, **kwargs) -> list[float]:
    """A sparse 0/1 reward (like a correctness check): 1 for a completion of 6 words or more. With one group per
    step, the step's only group is all 0 (or, once learned, all 1) now and then by chance: `reward_std` is then 0 and
    `frac_reward_zero_std` 1 on a clean run."""
    return [float(len(str(c).split()) >= 6) for c in completions]


# name -> (kind, preset, config fields, reward function)
WORKLOADS: dict[str, tuple[str, str, dict, Callable]] = {
    "grpo-shipped": ("grpo", "quick", dict(SHIPPED, beta=0.0), length),
    "rloo-shipped": ("rloo", "quick", dict(SHIPPED, beta=0.05), length),
    "grpo-learning": ("grpo", "quick", LEARNING, word_count),
    "rloo-learning": ("rloo", "quick", dict(LEARNING, bf16=False), word_count),
    "grpo-sparse": ("grpo", "quick", LEARNING, six_words_or_more),
    "rloo-sparse": ("rloo", "quick", dict(LEARNING, bf16=False), six_words_or_more),
    "grpo-quick": ("grpo", "quick", {}, PRESETS["quick"].reward),
    "rloo-quick": ("rloo", "quick", {}, PRESETS["quick"].reward),
    "grpo-guarded": ("grpo", "guarded", dict(save_strategy="no"), PRESETS["guarded"].reward),
    "rloo-guarded": ("rloo", "guarded", dict(save_strategy="no", bf16=False), PRESETS["guarded"].reward),
}


class LearningRateTimes100(TrainerCallback):
    """From step `at` on, the learning rate x100: the scheduler's base rates (and the current rate) scaled once."""

    def __init__(self, trainer, at: int):
        self.trainer, self.at = trainer, at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            scheduler = self.trainer.lr_scheduler
            scheduler.base_lrs = [lr * 100 for lr in scheduler.base_lrs]
            for group in self.trainer.optimizer.param_groups:
                group["lr"] *= 100


def turning_constant(reward: Callable, trainer_box: list, at: int) -> Callable:
    """`reward`, until the trainer's step reaches `at`; then 1.0 for every completion."""

    def reward_func(completions, **kwargs):
        if trainer_box and trainer_box[0].state.global_step >= at:
            return [1.0] * len(completions)
        return reward(completions, **kwargs)

    reward_func.__name__ = getattr(reward, "__name__", "reward")
    return reward_func


def run(name: str, model: str, steps: int, seed: int, inject: str | None, at: int) -> tuple[list[dict], float]:
    """One run of workload `name`; returns its `collapse` events and the seconds it took."""
    kind, preset, config, reward = WORKLOADS[name]
    box: list = []
    if inject == "reward":
        reward = turning_constant(reward, box, at)
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(
            kind, model, out, preset=preset, max_steps=steps, seed=seed, logging_steps=1,
            collapse_signals=list(SIGNAL_NAMES), trainer_kwargs={"reward_funcs": reward}, **config,
        )  # fmt: skip
        box.append(trainer)
        trainer.remove_callback(PrinterCallback)  # logging_steps=1: no log line per step on the console
        if inject == "lr":
            trainer.add_callback(LearningRateTimes100(trainer, at))
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        events = [e for e in read_events(out) if e["kind"] == "collapse"]
        series = [{k: v for k, v in log.items()} for log in trainer.state.log_history]
    return events, seconds, series


def moved(series: list[dict], at: int, after: int) -> list[str]:
    """Per signal, its metric's median over the 16 steps up to `at` -> over the `after` steps past it (`?`: not
    logged): whether the injection moved the metric at all."""
    out = []
    for rule in SIGNALS:
        before = [log[rule.key] for log in series if rule.key in log and at - 16 < log.get("step", 0) <= at]
        past = [log[rule.key] for log in series if rule.key in log and at < log.get("step", 0) <= at + after]
        before, past = [v for v in before if v is not None], [v for v in past if v is not None]
        out.append(f"{statistics.median(before):.3g} -> {statistics.median(past):.3g}" if before and past else "?")
    return out


def replayed(series: list[dict]) -> list[dict]:
    """The `collapse` events the watch, with every signal on and the default window and patience, gives on a kept
    log history."""
    from safe_trainers.arguments import SafetyArguments
    from safe_trainers.collapse.watch import CollapseWatch

    settings = SafetyArguments()
    watch = CollapseWatch(SIGNAL_NAMES, settings.collapse_window, settings.collapse_patience)
    for log in series:
        if "train_runtime" not in log:
            watch.step_end(log["step"], {k: [v] for k, v in log.items() if isinstance(v, (int, float))})
            watch.metrics.logged()  # each kept log is one step's (`logging_steps=1`): TRL cleared after it
    return [{"step": step, "signal": name} for step, name in watch.episodes]


def replay(paths: list[str], at: int, after: int) -> None:
    """The tables of [`main`] from kept runs (`--series` files): `<workload>/clean/<seed>`, `<workload>/lr`,
    `<workload>/reward`."""
    runs: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            runs.update(json.load(f))
    false_rows, delay_rows, move_rows = [], [], []
    for name in [w for w in WORKLOADS if any(run.startswith(f"{w}/") for run in runs)]:
        clean = [series for run, series in runs.items() if run.startswith(f"{name}/clean/")]
        alarms = dict.fromkeys(SIGNAL_NAMES, 0)
        for series in clean:
            for event in replayed(series):
                alarms[event["signal"]] += 1
        steps = sum(sum(1 for log in series if "train_runtime" not in log) for series in clean)
        false_rows.append((name, f"{steps} ({len(clean)} runs)", *[alarms[s] for s in SIGNAL_NAMES]))
        for inject, label in (("lr", "lr x100"), ("reward", "constant reward")):
            series = runs.get(f"{name}/{inject}")
            if series is None:
                continue
            first: dict[str, int] = {}
            for event in replayed(series):
                first.setdefault(event["signal"], event["step"] - at)
            delay_rows.append((name, label, *[first.get(s, "-") for s in SIGNAL_NAMES]))
            move_rows.append((name, label, *moved(series, at, after)))
    print("False alarms (collapse episodes on clean runs):\n")
    print(markdown_table(["workload", "steps", *SIGNAL_NAMES], false_rows))
    print(f"\nDelay after k={at} (steps to the first collapse episode; '-': none in {after} steps):\n")
    print(markdown_table(["workload", "injected", *SIGNAL_NAMES], delay_rows))
    print(f"\nEach metric's median over the 16 steps up to k -> over the {after} steps after (did it move?):\n")
    print(markdown_table(["workload", "injected", *SIGNAL_NAMES], move_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=150, help="steps of each clean run")
    parser.add_argument("--seeds", type=int, default=2, help="clean runs per workload")
    parser.add_argument("--inject-at", type=int, default=40, help="k: the step the injected collapse starts at")
    parser.add_argument("--after", type=int, default=15, help="steps an injected run trains past k")
    parser.add_argument("--series", default=None, help="write every run's log history to this JSON file")
    parser.add_argument("--replay", nargs="+", default=None, help="judge kept `--series` files instead of training")
    ns = parser.parse_args()
    if ns.replay:
        return replay(ns.replay, ns.inject_at, ns.after)
    quiet()
    model = save_toy_model(os.path.join(tempfile.mkdtemp(), "qwen2"), "qwen2")
    false_rows, delay_rows, move_rows, all_series = [], [], [], {}
    for name in ns.workloads:
        alarms = dict.fromkeys(SIGNAL_NAMES, 0)
        total, seconds = 0, 0.0
        for seed in range(ns.seeds):
            events, took, series = run(name, model, ns.steps, seed, None, 0)
            all_series[f"{name}/clean/{seed}"] = series
            total, seconds = total + ns.steps, seconds + took
            for event in events:
                alarms[event["signal"]] += 1
                print(f"  false alarm: {name} seed {seed} step {event['step']}: {event}", flush=True)
        false_rows.append((name, total, *[alarms[s] for s in SIGNAL_NAMES], f"{seconds / total:.2f}"))
        print(markdown_table(["workload", "steps", *SIGNAL_NAMES, "s/step"], false_rows[-1:]), flush=True)
        for inject in ("lr", "reward"):
            events, _, series = run(name, model, ns.inject_at + ns.after, 0, inject, ns.inject_at)
            all_series[f"{name}/{inject}"] = series
            first = {}
            for event in events:
                first.setdefault(event["signal"], event["step"] - ns.inject_at)
            label = "lr x100" if inject == "lr" else "constant reward"
            delay_rows.append((name, label, *[first.get(s, "-") for s in SIGNAL_NAMES]))
            move_rows.append((name, label, *moved(series, ns.inject_at, ns.after)))
            print(markdown_table(["workload", "injected", *SIGNAL_NAMES], delay_rows[-1:]), flush=True)
    print("\nFalse alarms (collapse events on clean runs):\n")
    print(markdown_table(["workload", "steps", *SIGNAL_NAMES, "s/step"], false_rows))
    print(f"\nDelay after k={ns.inject_at} (steps to the first collapse event; '-': none in {ns.after} steps):\n")
    print(markdown_table(["workload", "injected", *SIGNAL_NAMES], delay_rows))
    print(f"\nEach metric's median over the 16 steps up to k -> over the {ns.after} steps after (did it move?):\n")
    print(markdown_table(["workload", "injected", *SIGNAL_NAMES], move_rows))
    if ns.series:
        with open(ns.series, "w") as f:
            json.dump(all_series, f)


if __name__ == "__main__":
    main()
