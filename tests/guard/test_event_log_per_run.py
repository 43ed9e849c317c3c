"""Each run starts its own event log. Real training on CPU, faults injected.
"""

from __future__ import annotations

import os

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.guard import read_events


def test_a_new_run_starts_its_own_event_log(toy_models, tmp_path):
    build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=3, kind="loss")], max_steps=4
    ).train()
    second = build_trainer("dpo", toy_models["qwen2"], tmp_path, preset="guarded", max_steps=4)
    second.train()
    assert read_events(str(tmp_path)) == []
    kept = read_events_file(tmp_path / "nan_events.previous-1.jsonl")
    assert [e["kind"] for e in kept] == ["skip"]
    resumed = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=6, kind="loss")], max_steps=8
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert [e["step"] for e in read_events(str(tmp_path))] == [6]  # appended to the resumed run's (empty) log
    assert not os.path.exists(tmp_path / "nan_events.previous-2.jsonl")


def read_events_file(path):
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
