"""Benchmark: the collapse watch's streak rule (`collapse/signals.py` `needed_streak`) on long simulated series of
`reward_std` for a sparse 0/1 reward with one group per step, through the real `CollapseWatch` (defaults: window 32,
patience 3). No training: the series stand for what TRL logs when a step's only group is all equal (`reward_std` 0)
with a given chance, else has a spread (0.35 to 0.55). `frac_reward_zero_std` of one group per step is the same
series turned around (1 where `reward_std` is 0) and is judged alike.

Tables: (1) false alarms per 10,000 steps of a clean run, per chance of an all-equal group, stationary and in blocks
of a curriculum (the chance alternating between two levels); (2) the delay of a reward turning constant at step 200,
per chance (median and worst over seeds; '-' when not reported within 40 steps).

    python bench/collapse_streaks.py                 # about a minute
    python bench/collapse_streaks.py --steps 20000   # faster, noisier
"""

from __future__ import annotations

import argparse
import random
import statistics

from workload import markdown_table

from safe_trainers.collapse.signals import STREAK_CHANCE
from safe_trainers.collapse.watch import CollapseWatch

WINDOW, PATIENCE = 32, 3


def episodes(values: list[float]) -> list[int]:
    """The steps at which the watch (only `reward_std`) starts an episode on `values`."""
    watch = CollapseWatch(["reward_std"], WINDOW, PATIENCE)
    for step, value in enumerate(values, start=1):
        watch.step_end(step, {"reward_std": [value]})
        watch.metrics.logged()
    return [step for step, _ in watch.episodes]


def spread_or_zero(chance: float, rng: random.Random) -> float:
    return 0.0 if rng.random() < chance else 0.35 + 0.2 * rng.random()


def stationary(steps: int, chance: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [spread_or_zero(chance, rng) for _ in range(steps)]


def blocks(steps: int, low: float, high: float, length: int, seed: int) -> list[float]:
    """A curriculum: the chance of an all-equal group alternates between `low` and `high` every `length` steps."""
    rng = random.Random(seed)
    return [spread_or_zero(low if (step // length) % 2 == 0 else high, rng) for step in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="steps of each clean series")
    parser.add_argument("--seeds", type=int, default=40, help="injected series per chance")
    ns = parser.parse_args()
    per = 10_000 / ns.steps
    rows = []
    for chance in (0.1, 0.2, 1 / 3, 0.5, 0.6):
        rows.append((f"stationary, chance {chance:.2f}", f"{len(episodes(stationary(ns.steps, chance, 1))) * per:.1f}"))
    for low, high, length in ((0.0, 0.5, 100), (0.1, 0.6, 50)):
        found = episodes(blocks(ns.steps, low, high, length, 1))
        rows.append((f"blocks of {length}: chance {low} / {high}", f"{len(found) * per:.1f}"))
    nominal = f"STREAK_CHANCE = {STREAK_CHANCE:g}: {STREAK_CHANCE * 1e4:g} nominal"
    print(f"False alarms per 10,000 clean steps ({nominal}):\n")
    print(markdown_table(["clean series", "episodes / 10k steps"], rows))
    rows = []
    for chance in (0.0, 0.1, 1 / 3, 0.5):
        delays = []
        for seed in range(ns.seeds):
            values = stationary(200, chance, seed) + [0.0] * 40
            found = episodes(values)
            if found and found[0] > 200:
                delays.append(found[0] - 200)
        worst = max(delays) if delays else "-"
        median = statistics.median(delays) if delays else "-"
        rows.append((f"{chance:.2f}", median, worst, f"{len(delays)}/{ns.seeds}"))
    print("\nA reward turning constant at step 200 (`reward_std` 0 from step 201): steps until the episode\n")
    print(markdown_table(["chance of an all-equal group", "median", "worst", "reported (no alarm before)"], rows))


if __name__ == "__main__":
    main()
