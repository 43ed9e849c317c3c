"""Review of the events in TensorBoard and W&B (`trainer/reporting.py`), with the real writers: a run that aborts
(`TrainingDivergedError` leaves `train()`, so no `on_train_end`) with `logging_steps=2` and the skips on a logging
step, and `event_alert_interval=0`, which must reach W&B as "no wait" rather than W&B's own default of one minute; a
run that dies of another error after a skip leaves W&B's summary with the counters of that skip."""

from __future__ import annotations

import json
import time

import pytest
from transformers import TrainerCallback

from safe_trainers.errors import TrainingDivergedError
from safe_trainers.guard import read_events
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, its runs under `tmp_path`. W&B keeps the settings it read from the environment at its first run
    in a process-wide singleton (so a later test's `WANDB_DIR` would be ignored): torn down before and after."""
    import wandb

    wandb.teardown()
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_PROJECT": "safe-trainers-test"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    yield wandb
    wandb.finish()
    wandb.teardown()


def test_an_abort_reaches_tensorboard_and_wandb_before_train_raises_and_interval_zero_waits_for_nothing(
    toy_models, tmp_path, monkeypatch, offline_wandb
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_records import finished_records, history_rows, of_kind, run_file
    from wandb_records import summary as wandb_summary

    wandb = offline_wandb
    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))
    # Every step from 3 on fails and no rollback is allowed: skips at 3 to 6 (4 and 6 are logging steps), then abort.
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path / "out", preset="guarded", faults=[Fault(3, "loss", repeat=1000)],
        nan_max_rollbacks=0, report_to=["wandb", "tensorboard"], event_alert_interval=0, logging_steps=2,
    )  # fmt: skip
    try:
        with pytest.raises(TrainingDivergedError):
            trainer.train()
        events = [(e["step"], e["kind"]) for e in read_events(str(tmp_path / "out"))]
        assert events == [(3, "skip"), (4, "skip"), (5, "skip"), (6, "skip"), (6, "abort")]
        # TensorBoard: every marker is flushed by the time the error leaves `train()` (no `on_train_end` ran).
        accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
        accumulator.Reload()
        assert [s.step for s in accumulator.Scalars("nan_guard/events/skip")] == [3, 4, 5, 6]
        assert [s.step for s in accumulator.Scalars("nan_guard/events/abort")] == [6]
        # The Trainer's row of the logging step that was itself skipped carries the counters.
        assert [(s.step, s.value) for s in accumulator.Scalars("train/nan_guard/skipped_steps")] == [(2, 0), (4, 2)]
    finally:
        wandb.finish()
    written = finished_records(run_file(str(tmp_path)))
    alerts = of_kind(written, "alert")
    assert [(a.title, a.level) for a in alerts] == [("safe_trainers: update skipped", "WARN")] * 4 + [
        ("safe_trainers: abort", "ERROR")
    ]
    # `event_alert_interval=0` is "one alert per event": W&B reads a `wait_duration` of 0 as its default (1 minute)
    # and its server drops an alert of the same title within it, so 3 of the 4 skips would never reach anyone.
    assert all(a.wait_duration < 1000 for a in alerts), [a.wait_duration for a in alerts]
    summary = wandb_summary(written)
    # The counters as they were when the run stopped, though `on_train_end` (the final summary) never ran.
    assert summary["nan_guard/skipped_steps"] == 4 and summary["nan_guard/discarded_steps"] == 4
    assert summary["nan_guard/events/skip"] == 4 and summary["nan_guard/events/abort"] == 1
    rows = history_rows(written)
    assert [(row["train/global_step"], row["train/nan_guard/skipped_steps"]) for row in rows] == [(2, 0), (4, 2)]


class CrashAt(TrainerCallback):
    """Ends the run with an error that is not the guard's (a dead data loader, a lost node) as step `step` begins:
    no `on_train_end`, so W&B's summary keeps what the last event put there."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("the data loader died")


def test_the_wandb_summary_written_with_an_event_counts_that_event(toy_models, tmp_path, offline_wandb):
    from wandb_records import finished_records, run_file

    wandb = offline_wandb
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path / "out", preset="guarded", faults=[Fault(3, "loss")], report_to=["wandb"]
    )
    trainer.add_callback(CrashAt(6))
    try:
        with pytest.raises(RuntimeError, match="data loader died"):
            trainer.train()
    finally:
        wandb.finish()
    assert [(e["step"], e["kind"]) for e in read_events(str(tmp_path / "out"))] == [(3, "skip")]
    summary = {}
    for r in finished_records(run_file(str(tmp_path))):
        if r.WhichOneof("record_type") == "summary":
            summary.update({item.key: json.loads(item.value_json) for item in r.summary.update})
    # The guard counted the skip after it added the event, so the summary said 0 skipped steps beside 1 `skip` event.
    assert summary["nan_guard/events/skip"] == 1 and summary["nan_guard/skipped_steps"] == 1


class PauseAt(TrainerCallback):
    """Sleeps `seconds` as step `step` begins (a slow step, so that the alert interval passes)."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            time.sleep(self.seconds)


def test_the_first_alert_after_the_interval_counts_the_held_back_events(toy_models, tmp_path, offline_wandb):
    from wandb_records import finished_records, run_file

    # Skips at 3 and 4 (one inspection: `logging_steps=2`), then a 6 s step, then a skip at 8, with a 4 s interval.
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path / "out", preset="guarded", report_to=["wandb"], logging_steps=2,
        faults=[Fault(3, "loss"), Fault(4, "loss"), Fault(8, "loss")], event_alert_interval=4,
    )  # fmt: skip
    trainer.add_callback(PauseAt(6, 6.0))
    trainer.train()
    offline_wandb.finish()
    assert [(e["step"], e["kind"]) for e in read_events(str(tmp_path / "out"))] == [(3, "skip"), (4, "skip"),
                                                                                    (8, "skip")]  # fmt: skip
    alerts = [r.alert for r in finished_records(run_file(str(tmp_path))) if r.WhichOneof("record_type") == "alert"]
    assert [a.text.split(":")[0] for a in alerts] == ["step 3", "step 8"]
    assert "more `skip`" not in alerts[0].text and alerts[1].text.endswith(
        "(1 more `skip` events since the last alert of this kind.)"
    )
    assert [a.wait_duration for a in alerts] == [2000, 2000]
