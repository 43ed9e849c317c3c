"""How far a rollback goes under the adaptive snapshot interval (`guard/snapshot_interval.py`), as a property over
fault schedules on a real tiny trainer: whatever the faults, the saves, evaluations, a save a later callback asks for,
gradient accumulation, the log cadence and the interval's settings (fixed, stretched to `save_steps`, shrunk to its
lower bound), on every example:

* the final weights and every checkpoint are finite (or the run stopped with `TrainingDivergedError`);
* the interval stays within its bounds (`nan_snapshot_steps`, else 1, to `save_steps`; exactly `nan_snapshot_steps`,
  else 10, when fixed);
* every rollback restores a snapshot the guard took (`taken_at`), at most the longest interval in force since that
  snapshot plus the steps skipped in a row before the fault, counted from the snapshot or from the last rollback
  that restored it (`global_step` never rewinds: a second rollback to the same snapshot goes back to it again);
* the event log tells that bound as docs/guard.md says to read it (test_interval_breaks.py's `how_far_it_could_go`).
"""

from __future__ import annotations

import time

from guard_utils import fault_schedules, nonfinite_in_checkpoints, weights_finite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_
from test_interval_breaks import how_far_it_could_go, skips_before
from transformers import TrainerCallback

import safe_trainers as st
from safe_trainers.guard import read_events
from safe_trainers.testing.build import build_trainer

MAX_STEPS = 14
faults = fault_schedules(MAX_STEPS, max_repeat=4)
runs = st_.fixed_dictionaries(
    {
        "gradient_accumulation_steps": st_.sampled_from([1, 2]),
        "logging_steps": st_.sampled_from([1, 5, 100]),
        "save_steps": st_.sampled_from([3, 4, 7, 100]),
        "nan_snapshot_steps": st_.sampled_from([None, 2, 3]),
        # 0: fixed; 1e-9: no snapshot fits (up to `save_steps`); 0.9 with slow steps: every snapshot fits (down to the
        # lower bound)
        "nan_snapshot_budget": st_.sampled_from([0.0, 1e-9, 0.9]),
    }
)


class Watch(TrainerCallback):
    """After the guard's callback: the interval in force after each step; every step sleeps `sleep` seconds; asks for
    a save at step `save_at` (a later callback's save)."""

    def __init__(self, trainer, sleep: float, save_at: int | None):
        self.trainer, self.sleep, self.save_at = trainer, sleep, save_at
        self.in_force: dict[int, int] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(self.sleep)

    def on_step_end(self, args, state, control, **kwargs):
        self.in_force[state.global_step] = self.trainer.nan_guard.interval.steps
        if state.global_step == self.save_at:
            control.should_save = True


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    schedule=faults,
    run=runs,
    eval_steps=st_.sampled_from([None, 3, 5]),
    save_at=st_.sampled_from([None, 5, 8]),
    sleep=st_.sampled_from([0.0, 0.05]),
)
def test_a_rollback_goes_back_at_most_the_interval_in_force(
    toy_models, tmp_path_factory, schedule, run, eval_steps, save_at, sleep
):
    evaluation = dict(eval_strategy="steps", eval_steps=eval_steps, metric_for_best_model="eval_loss")
    out = tmp_path_factory.mktemp("run") / "out"
    trainer = build_trainer(
        "sft", toy_models["qwen2"], out, preset="guarded", faults=schedule, max_steps=MAX_STEPS,
        eval_rows=4 if eval_steps else 0, **run, **(evaluation if eval_steps else {}),
    )  # fmt: skip
    watch = Watch(trainer, sleep, save_at)
    trainer.add_callback(watch)
    try:
        trainer.train()
    except st.TrainingDivergedError:
        pass
    events = read_events(str(out))
    assert weights_finite(trainer) and not nonfinite_in_checkpoints(str(out))

    interval = trainer.nan_guard.interval
    lower, upper, fixed = run["nan_snapshot_steps"] or 1, run["save_steps"], run["nan_snapshot_budget"] == 0
    started = (run["nan_snapshot_steps"] or 10) if fixed else min(interval.start_steps, max(lower, upper))
    for step, steps in watch.in_force.items():
        assert steps == started if fixed else lower <= steps <= max(lower, upper), (step, steps)

    rollbacks = [e for e in events if e["kind"] == "rollback"]
    for rollback in rollbacks:
        restored, fault = rollback["restored_step"], rollback["fault_step"]
        assert restored in interval.taken_at, (rollback, interval.taken_at)
        since = max([restored] + [e["step"] for e in rollbacks if e["restored_step"] == restored and e is not rollback
                                  and e["step"] < rollback["step"]])  # fmt: skip
        longest = max([started if restored == 0 else watch.in_force.get(restored, started)]
                      + [watch.in_force[s] for s in range(restored + 1, fault) if s in watch.in_force])  # fmt: skip
        assert fault - since <= longest + skips_before(events, fault), (rollback, longest, since, events)
        assert fault - since <= how_far_it_could_go(events, rollback, started), (rollback, events)
