"""Files of `output_dir` the run did not write as it reads them: a damaged or malformed checkpoint file is passed over
with the reason (a good older checkpoint is resumed from), a bad line of the event log is skipped with a warning, a
malformed step record is not used. Nothing of it raises out of the resume, and nothing is read outside the
checkpoint or past a bound.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct

import pytest
from guard_utils import recording
from safetensors.torch import save_file
import torch

from safe_trainers.guard import read_events
from safe_trainers.restarts.checkpoint_choice import choose_checkpoint
from safe_trainers.restarts.progress import read_progress
from safe_trainers.testing.build import build_trainer
from safe_trainers.trainers import trainer_class


@pytest.fixture
def run(finished_run, tmp_path):
    out, seen = finished_run
    copy = str(tmp_path / "out")
    shutil.copytree(out, copy)
    return copy, seen


def outside_weights(tmp_path) -> str:
    """A valid weight file outside the checkpoint (an index naming it must not make the checkpoint usable)."""
    path = str(tmp_path / "x")
    save_file({"w": torch.zeros(2)}, path)
    return path


def header(entries: dict) -> bytes:
    raw = json.dumps(entries).encode()
    return struct.pack("<Q", len(raw)) + raw


INDEX = "model.safetensors.index.json"
# (name, file in checkpoint-4, its content (bytes, or a function of tmp_path giving them), the reason's start)
DAMAGE = [
    ("index_weight_map_list", INDEX, b'{"weight_map": []}', f"incomplete: `{INDEX}` holds no `weight_map`"),
    ("index_shard_not_a_name", INDEX, b'{"weight_map": {"a": 5}}', f"incomplete: `{INDEX}` holds no `weight_map`"),
    ("index_truncated", INDEX, b'{"weight_map": {"a": "mod', f"incomplete: `{INDEX}` does not parse"),
    ("index_not_utf8", INDEX, b'{"weight_map": {"\xff": "a"}}', f"incomplete: `{INDEX}` does not parse"),
    ("index_shard_climbs_out", INDEX, lambda tmp: json.dumps({"weight_map": {"w": "../../x"}}).encode(),
     f"incomplete: `{INDEX}` names a shard outside the checkpoint (`../../x`)"),
    ("index_shard_absolute", INDEX, lambda tmp: json.dumps({"weight_map": {"w": outside_weights(tmp)}}).encode(),
     f"incomplete: `{INDEX}` names a shard outside the checkpoint"),
    ("safetensors_entry_not_object", "model.safetensors", header({"w": 5}),
     "incomplete: `model.safetensors` has a header entry `w` without two integer `data_offsets`"),
    ("safetensors_entry_no_offsets", "model.safetensors", header({"w": {"dtype": "F32", "shape": [2]}}),
     "incomplete: `model.safetensors` has a header entry `w`"),
    ("safetensors_header_huge", "model.safetensors", struct.pack("<Q", 2**62) + b"{}" * 8,
     "incomplete: `model.safetensors` has a header length of 4611686018427387904 bytes, over the"),
    ("trainer_state_wrong_types", "trainer_state.json", b'{"global_step": 4, "log_history": 5}',
     "incomplete: `trainer_state.json` holds `log_history` of type `int`"),
    ("guard_state_list", "nan_guard_state.json", b"[1, 2]", "incomplete: `nan_guard_state.json` is a JSON `list`"),
    ("guard_state_wrong_types", "nan_guard_state.json", b'{"skipped_steps": "x"}',
     "incomplete: `nan_guard_state.json` holds `skipped_steps` of type `str`"),
    ("trainer_state_nested", "trainer_state.json", b"[" * 100_000,
     "incomplete: `trainer_state.json` does not parse (RecursionError"),
    ("index_nested", INDEX, b'{"weight_map": ' + b"[" * 100_000,
     f"incomplete: `{INDEX}` does not parse (RecursionError"),
    ("safetensors_header_nested", "model.safetensors", struct.pack("<Q", 100_000) + b"[" * 100_000,
     "incomplete: `model.safetensors` has a header that does not parse (RecursionError"),
    ("trainer_state_unknown_field", "trainer_state.json", b'{"global_step": 4, "loss_scale": 1}',
     "incomplete: `trainer_state.json` holds `loss_scale`, not a field of transformers' `TrainerState`"),
    ("guard_state_spike_overflow", "nan_guard_state.json",
     b'{"spike_window": {"loss": [1' + b"0" * 400 + b'], "grad_norm": [1.0]}}',
     "incomplete: `nan_guard_state.json` holds a `spike_window` that is not lists of numbers"),
]  # fmt: skip


def damage(out: str, tmp_path, name: str, content) -> str:
    checkpoint = os.path.join(out, "checkpoint-4")
    if callable(content):
        content = content(tmp_path)
    with open(os.path.join(checkpoint, name), "wb") as f:
        f.write(content)
    outside = tmp_path / "x"
    if not outside.exists():  # `../../x` from checkpoint-4, as a valid weight file
        outside_weights(tmp_path)
    return checkpoint


@pytest.mark.parametrize("case,name,content,reason", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_file_passes_the_checkpoint_over_with_the_reason(run, tmp_path, case, name, content, reason):
    out, _ = run
    checkpoint = damage(out, tmp_path, name, content)
    choice = choose_checkpoint(out)
    assert choice.path == os.path.join(out, "checkpoint-2")
    (passed,) = choice.passed_over
    assert passed.path == checkpoint and passed.reason.startswith(reason), passed.reason


@pytest.mark.parametrize(
    "case",
    ["index_shard_climbs_out", "safetensors_entry_not_object", "guard_state_list", "trainer_state_unknown_field"],
)
def test_resume_true_goes_on_from_the_good_checkpoint_beside_a_damaged_one(run, tmp_path, toy_models, case):
    out, seen = run
    name, content, reason = next(d[1:] for d in DAMAGE if d[0] == case)
    damage(out, tmp_path, name, content)
    resumed = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=4, save_steps=2,
                            trainer_cls=recording(trainer_class("dpo")))  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    assert resumed.seen == seen[2:]  # steps 3 and 4: from checkpoint-2
    event = [e for e in read_events(out) if e["kind"] == "resume"][-1]
    assert event["checkpoint"] == os.path.join(out, "checkpoint-2")
    assert event["passed_over"][0]["reason"].startswith(reason)


def test_a_bad_line_of_the_event_log_is_skipped_with_a_warning(run, toy_models, caplog):
    out, _ = run
    lines = [
        json.dumps({"step": 1, "kind": "skip", "nonfinite": ["loss"], "ranks": [0]}),
        '{"step": 2, "kind": "sk',  # a line cut short
        '{"step": "x"}',
        "[1, 2]",
        "[" * 100_000,  # nested past Python's recursion limit
        json.dumps({"step": 3, "kind": "skip", "nonfinite": ["loss"], "ranks": [0]}),
    ]
    with open(os.path.join(out, "nan_events.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")
    assert [e["step"] for e in read_events(out)] == [1, 3]
    resumed = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=4, save_steps=2,
                            trainer_cls=recording(trainer_class("dpo")))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="safe_trainers"):
        resumed.train(resume_from_checkpoint=True)
    assert getattr(resumed, "seen", []) == []  # nothing left to train after checkpoint-4: it resumed, did not fail
    assert [(e["step"], e["kind"]) for e in read_events(out)] == [(1, "skip"), (3, "skip"), (4, "resume")]
    assert "line 2 of" in caplog.text and "it is skipped" in caplog.text
    with open(os.path.join(out, "nan_events.previous-1.jsonl")) as f:  # the full log, bad lines too, is kept
        assert f.read().splitlines() == lines


@pytest.mark.parametrize(
    "change",
    [{"attempt": "x"}, {"phase": "bogus"}, {"checkpoints": ["4"]}, {"deaths": [{"attempt": 0, "step": "7"}]},
     {"launch": 5}, {"restart": None}],
)  # fmt: skip
def test_a_malformed_step_record_is_not_used(tmp_path, change):
    record = {"attempt": 1, "step": 3, "phase": "step", "data": "world=1", "restart": 0, "stage": 1, "deaths": [],
              "poisoned": [], "checkpoints": [2], "launch": ["a"], "origin": None, "result": None}  # fmt: skip
    path = tmp_path / ".safe_trainers_progress.json"
    path.write_text(json.dumps(record))
    assert read_progress(str(tmp_path)).step == 3
    path.write_text(json.dumps({**record, **change}))
    assert read_progress(str(tmp_path)) is None


def test_a_step_record_nested_past_the_recursion_limit_is_not_used(tmp_path):
    (tmp_path / ".safe_trainers_progress.json").write_text("[" * 100_000)
    assert read_progress(str(tmp_path)) is None


def test_a_spike_window_of_numbers_no_float_holds_passes_the_checkpoint_over(run, toy_models, tmp_path):
    out, seen = run
    name, content, reason = next(d[1:] for d in DAMAGE if d[0] == "guard_state_spike_overflow")
    damage(out, tmp_path, name, content)
    resumed = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=6, save_steps=2,
                            nan_spike_factor=3.0, trainer_cls=recording(trainer_class("dpo")))  # fmt: skip
    resumed.train(resume_from_checkpoint=True)  # the window is read at the first step
    assert [step for step, _ in resumed.seen] == [3, 4, 5, 6]  # from checkpoint-2
    event = [e for e in read_events(out) if e["kind"] == "resume"][-1]
    assert event["passed_over"][0]["reason"].startswith(reason)


@pytest.mark.parametrize(
    "latest,files,reason",
    [
        (None, True, "incomplete: `latest` is missing or not a file"),
        (b"global_step9\n", True, "incomplete: `latest` names `global_step9`, no DeepSpeed state directory"),
        (b"global_step4\n", False, "incomplete: `latest` names `global_step4`, which holds no state file"),
        (b"global_step4\n", True, None),
    ],
    ids=["no_latest", "latest_names_no_directory", "empty_state_directory", "healthy"],
)
def test_deepspeed_state_that_latest_does_not_name_passes_the_checkpoint_over(run, latest, files, reason):
    # DeepSpeed resumes from the tag its `latest` file names; without a usable one transformers' resume raised
    # "[deepspeed] failed to resume from checkpoint" (the choice took the checkpoint).
    out, _ = run
    state = os.path.join(out, "checkpoint-4", "global_step4")
    os.makedirs(state)
    if files:
        torch.save({"module": {"w": torch.zeros(2)}}, os.path.join(state, "mp_rank_00_model_states.pt"))
    if latest is not None:
        with open(os.path.join(out, "checkpoint-4", "latest"), "wb") as f:
            f.write(latest)
    choice = choose_checkpoint(out)
    if reason is None:
        assert choice.path == os.path.join(out, "checkpoint-4") and not choice.passed_over
        return
    assert choice.path == os.path.join(out, "checkpoint-2")
    (passed,) = choice.passed_over
    assert passed.reason.startswith(reason), passed.reason
