"""Review of the collapse watch: what it reads of TRL's metrics when the guard's diagnosis replay puts back a copy of
them (`trainer/replay.py`)."""

from __future__ import annotations

import copy

from safe_trainers.collapse.watch import StepMetrics


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
