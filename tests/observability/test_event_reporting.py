"""The run's events in TensorBoard and W&B (`trainer/reporting.py`, docs/observability.md), with the real writers:
a guarded DPO run with two skipped steps and a rollback, its TensorBoard event files and its offline W&B run read
back; the alert rate limit on a fake clock; nothing of either with `report_to="none"`."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import typing

import pytest

from safe_trainers.guard import read_events
from safe_trainers.runtime.alerts import ALERT_LEVELS, AlertLimiter, alert_due
from safe_trainers.runtime.events import EventKind, RunEvent
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault

# Two skips (3, 5), then a damaged weight at 7: skipped and rolled back at step 7.
FAULTS = [Fault(step=3, kind="loss"), Fault(step=5, kind="loss"), Fault(step=7, kind="weight")]
EXPECTED = [(3, "skip"), (5, "skip"), (7, "skip"), (7, "rollback")]


def guarded_dpo(toy_models, tmp_path, **config):
    return build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=FAULTS, **config)


def test_every_event_kind_but_a_chosen_setting_raises_an_alert():
    # A new event kind must be given a level (or be added here as not an incident): a kind left out never alerts.
    assert set(ALERT_LEVELS) == set(typing.get_args(EventKind)) - {"snapshot_interval"}


def test_alert_rate_limit_per_kind():
    now = [0.0]
    limiter = AlertLimiter(600.0, clock=lambda: now[0])
    assert limiter.take("skip") == 0  # the first one goes out
    now[0] = 10.0
    assert limiter.take("skip") is None and limiter.take("skip") is None  # held back, counted
    assert limiter.take("rollback") == 0  # another kind has its own limit
    now[0] = 599.9
    assert limiter.take("skip") is None
    now[0] = 600.0
    assert limiter.take("skip") == 3  # the three held back since the last alert
    assert limiter.take("rollback") is None
    now[0] = 1200.0
    assert limiter.take("skip") == 0
    assert alert_due(None, 0.0, 600.0) and not alert_due(0.0, 599.0, 600.0) and alert_due(0.0, 0.0, 0.0)
    every = AlertLimiter(0.0, clock=lambda: 5.0)
    assert every.take("skip") == 0 and every.take("skip") == 0


def test_tensorboard_markers_at_the_events_steps(toy_models, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))  # transformers' own setting for its writer's dir
    trainer = guarded_dpo(toy_models, tmp_path / "out", report_to=["tensorboard"])
    trainer.train()
    events = read_events(str(tmp_path / "out"))
    assert [(e["step"], e["kind"]) for e in events] == EXPECTED
    assert len(glob.glob(str(logdir / "events.out.tfevents.*"))) >= 1  # the integration's own directory
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    for kind in ("skip", "rollback"):
        steps = [s.step for s in accumulator.Scalars(f"nan_guard/events/{kind}")]
        assert steps == [e["step"] for e in events if e["kind"] == kind]
    texts = accumulator.Tensors("nan_guard/events/text_summary")  # torch's writer adds `/text_summary`
    assert [t.step for t in texts] == [e["step"] for e in events]
    said = [t.tensor_proto.string_val[0].decode() for t in texts]
    assert said[0].startswith("step 3: update skipped; non-finite loss") and "rollback" in said[3]
    # The counters the Trainer logs stay there beside the markers.
    assert [s.value for s in accumulator.Scalars("train/nan_guard/skipped_steps")][-1] == 3
    assert "nan_guard/events/snapshot_interval" not in tags["scalars"]
    # An event added after the integration closed its writer (as `restore` and `preempt` are, when `train()` ends)
    # goes to the same directory, and the writer reopened for it is closed again.
    trainer.safe_run.events.add(RunEvent(10, "restore", ["weights_or_optimizer_state"], [0], {"restored_step": 8}))
    accumulator.Reload()
    assert [s.step for s in accumulator.Scalars("nan_guard/events/restore")] == [10]
    sink = trainer.safe_run.reporter.sinks[0]
    assert sink.callback.tb_writer is None and sink.writer.all_writers is None  # closed
    # Resumed from checkpoint-10 for two more steps: the `resume` event, added before TensorBoard's callback opened its
    # writer, reaches it at the resumed step.
    resumed = guarded_dpo(toy_models, tmp_path / "out", report_to=["tensorboard"], max_steps=12)
    resumed.train(resume_from_checkpoint=True)
    assert [(e["step"], e["kind"]) for e in read_events(str(tmp_path / "out"))][-1] == (10, "resume")
    accumulator.Reload()
    assert [s.step for s in accumulator.Scalars("nan_guard/events/resume")] == [10]
    texts = accumulator.Tensors("nan_guard/events/text_summary")
    assert [t.step for t in texts] == [3, 5, 7, 7, 10, 10]  # the restore, then the resume


def test_wandb_alerts_summary_and_history(toy_models, tmp_path, monkeypatch):
    from wandb_records import finished_records, history_rows, of_kind, run_file
    from wandb_records import summary as wandb_summary

    import wandb

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_PROJECT": "safe-trainers-test"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    trainer = guarded_dpo(toy_models, tmp_path / "out", report_to=["wandb"])
    try:
        trainer.train()
    finally:
        wandb.finish()
    events = read_events(str(tmp_path / "out"))
    assert [(e["step"], e["kind"]) for e in events] == EXPECTED
    written = finished_records(run_file(str(tmp_path)))
    alerts = of_kind(written, "alert")
    # One alert per kind: the second and third skips fall within the 10 minutes of the first.
    assert sorted(a.title for a in alerts) == ["safe_trainers: rollback", "safe_trainers: update skipped"]
    assert {a.title: a.level for a in alerts} == {"safe_trainers: rollback": "WARN",
                                                  "safe_trainers: update skipped": "WARN"}  # fmt: skip
    assert all(a.wait_duration == 300_000 for a in alerts)  # half the interval: W&B's own limit never drops ours
    summary = wandb_summary(written)
    assert summary["nan_guard/skipped_steps"] == 3 and summary["nan_guard/rollbacks"] == 1
    assert summary["nan_guard/events/skip"] == 3 and summary["nan_guard/events/rollback"] == 1
    rows = history_rows(written)
    with_loss = [row for row in rows if "train/loss" in row]
    assert len(with_loss) == 10  # one per logged step, none dropped
    assert all("train/nan_guard/skipped_steps" in row and "train/nan_guard/rollbacks" in row for row in with_loss)
    assert [row["train/nan_guard/skipped_steps"] for row in with_loss] == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]
    steps = [row["_step"] for row in rows]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # no row on a step already committed
    global_steps = [row["train/global_step"] for row in rows]
    assert global_steps == sorted(global_steps)


NOTHING_REPORTED = """
import sys
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
trainer = build_trainer("dpo", sys.argv[1], sys.argv[2], preset="guarded", max_steps=3, faults=[Fault(3, "loss")])
trainer.train()
assert trainer.safe_run.reporter is None and trainer.safe_run.events.observers == []
# transformers' `is_wandb_available()` imports wandb whenever it is installed (TRL calls it at import), so wandb may be
# loaded: no run of it is started. TensorBoard's writer is imported only by its callback.
assert "wandb" not in sys.modules or sys.modules["wandb"].run is None
print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorboard", "tensorboardX")
             or m.startswith("torch.utils.tensorboard")))
"""


def test_report_to_none_imports_and_writes_nothing(toy_models, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", NOTHING_REPORTED, toy_models["qwen2"], str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_DIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert [e["kind"] for e in read_events(str(out))] == ["skip"]
    assert not glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)
    assert not os.path.exists(tmp_path / "wandb") and not os.path.exists(out / "runs")


@pytest.mark.parametrize("report_to, expected", [(["none"], False), ("none", False), (["tensorboard"], True),
                                                 (["wandb", "mlflow"], True), (["mlflow"], False), ("all", True)])
def test_which_report_to_reaches_the_events(report_to, expected):
    from safe_trainers.trainer.reporting import reports_events

    assert reports_events(report_to) is expected


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_event_alert_interval_is_checked(tmp_path, value):
    from safe_trainers import DPOConfig

    with pytest.raises(ValueError, match=r"`event_alert_interval` must be a number of seconds >= 0"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, event_alert_interval=value)
    assert DPOConfig(output_dir=str(tmp_path), use_cpu=True, event_alert_interval=0).event_alert_interval == 0


def test_an_event_from_another_thread_never_waits_long_on_a_report_in_progress(monkeypatch, caplog):
    # The watchdog adds a `hang` event on its own thread, then exits the process: a main thread stuck in a writer's
    # flush, holding the reporter's lock, must not keep it from exiting.
    from safe_trainers.trainer import reporting

    monkeypatch.setattr(reporting, "LOCK_WAIT", 0.2)
    reporter = reporting.EventReporter(True, dict, 600.0)
    reporter.lock.acquire()  # a report stuck on the main thread
    done = threading.Event()
    thread = threading.Thread(target=lambda: (reporter(RunEvent(4, "hang")), done.set()))
    thread.start()
    assert done.wait(timeout=5), "the event waited for the stuck report"
    assert reporter.pending == [] and "was not reported" in caplog.text
    reporter.lock.release()
