"""Symbolic links in `output_dir` never redirect a write or a delete outside it: a staging directory that is a link
is refused (and nothing is deleted through it), the Trainer's own rotation never runs inside the staging directory,
and the files the run writes under fixed names are never written through a link (`runtime/files.py`). Real runs on CPU.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from guard_utils import checkpoint_steps
from transformers import TrainerCallback

from safe_trainers.runtime.files import open_append_no_follow, write_text_no_follow
from safe_trainers.runtime.checkpoint_dirs import STAGING_DIR
from safe_trainers.runtime.events import EVENTS_FILE
from safe_trainers.restarts.publishing import recover_staging
from safe_trainers.restarts.progress import PROGRESS_FILE
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


class AtStep(TrainerCallback):
    """Runs `action` at the end of step `step` (before that step's save)."""

    def __init__(self, step, action):
        self.step, self.action = step, action

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.action()


def _when_gone(path, timeout=120.0):
    """`path`, once nothing is there any more (waited for up to `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while os.path.lexists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return path


def _someone_elses_checkpoints(tmp_path):
    """A directory outside `output_dir` holding `checkpoint-*` folders."""
    elsewhere = tmp_path / "elsewhere"
    for step in (1, 2):
        (elsewhere / f"checkpoint-{step}").mkdir(parents=True)
        (elsewhere / f"checkpoint-{step}" / "weights.bin").write_text("precious")
    return elsewhere


@pytest.mark.parametrize("planted", ["before the run", "during the run"])
def test_a_staging_dir_that_is_a_link_is_refused_and_nothing_is_deleted_through_it(toy_models, tmp_path, planted):
    elsewhere = _someone_elses_checkpoints(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    link = out / STAGING_DIR
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], out, preset="guarded", save_steps=2, max_steps=4, save_total_limit=1
    )  # fmt: skip
    if planted == "before the run":
        link.symlink_to(elsewhere, target_is_directory=True)
    else:  # once checkpoint-2 is published: its staging directory is gone (a background writer may still hold it)
        trainer.add_callback(AtStep(3, lambda: _when_gone(link).symlink_to(elsewhere, target_is_directory=True)))
    with pytest.raises(FileExistsError, match=rf"`{link}` is a symbolic link \(to `{elsewhere}`\).*Remove it"):
        trainer.train()
    assert sorted(os.listdir(elsewhere)) == ["checkpoint-1", "checkpoint-2"]
    assert all((elsewhere / f"checkpoint-{s}" / "weights.bin").read_text() == "precious" for s in (1, 2))
    assert link.is_symlink()  # left for the user to remove, as the message says


def test_recovery_removes_links_in_the_staging_dir_without_following_them(tmp_path):
    elsewhere = _someone_elses_checkpoints(tmp_path)
    staging = tmp_path / "out" / STAGING_DIR
    staging.mkdir(parents=True)
    (staging / "checkpoint-7").symlink_to(elsewhere / "checkpoint-1", target_is_directory=True)
    (staging / "checkpoint-7.complete").write_text("")
    (staging / "leftover").symlink_to(elsewhere, target_is_directory=True)
    lines = recover_staging(str(tmp_path / "out"))
    assert lines == [f"removed `{staging / name}`, left in `{staging}`" for name in ("checkpoint-7", "leftover")]
    assert not staging.exists() and checkpoint_steps(str(tmp_path / "out")) == []  # a link is never published
    assert (elsewhere / "checkpoint-1" / "weights.bin").read_text() == "precious"


def test_the_trainers_own_rotation_never_runs_inside_the_staging_dir(toy_models, tmp_path):
    out = tmp_path / "out"
    planted = out / STAGING_DIR / "checkpoint-1"

    def plant():
        planted.mkdir(parents=True)
        (planted / "weights.bin").write_text("not the rotation's to delete")

    trainer = build_trainer(
        "dpo", toy_models["qwen2"], out, preset="guarded", save_steps=2, max_steps=4, save_total_limit=1
    )  # fmt: skip
    trainer.add_callback(AtStep(3, plant))
    trainer.train()
    assert (planted / "weights.bin").exists()  # transformers' rotation would have run in staging and deleted it
    assert checkpoint_steps(str(out)) == [4]  # rotation ran where it belongs


def _outside_file(tmp_path):
    target = tmp_path / "someone_elses.txt"
    target.write_text("untouched\n")
    return target


def test_whole_file_writes_replace_a_link_and_leave_its_target_alone(toy_models, tmp_path):
    target = _outside_file(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "safety_report.json").symlink_to(target)
    (out / "safety_report.json.tmp").symlink_to(target)  # the name a temporary file had
    build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=2, save_steps=2).train()
    assert target.read_text() == "untouched\n"
    assert not (out / "safety_report.json").is_symlink() and '"findings"' in (out / "safety_report.json").read_text()


def test_the_step_record_is_never_written_through_a_link(toy_models, tmp_path):
    target = _outside_file(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / PROGRESS_FILE).symlink_to(target)
    trainer = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=2, save_steps=2)
    with pytest.raises(FileExistsError, match=rf"`{out / PROGRESS_FILE}` is a symbolic link .*Remove the link"):
        trainer.train()
    assert target.read_text() == "untouched\n"


def test_the_event_log_is_never_appended_through_a_link(toy_models, tmp_path):
    out = tmp_path / "out"
    build_trainer(
        "dpo", toy_models["qwen2"], out, preset="guarded", faults=[Fault(step=1, kind="loss")], max_steps=2,
        save_steps=2,
    ).train()  # fmt: skip
    target = tmp_path / "someone_elses.jsonl"
    os.replace(out / EVENTS_FILE, target)  # the same events, so a resume keeps the log and appends to it
    before = target.read_text()
    (out / EVENTS_FILE).symlink_to(target)
    trainer = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=4, save_steps=2)
    with pytest.raises(FileExistsError, match=rf"`{out / EVENTS_FILE}` is a symbolic link"):
        trainer.train(resume_from_checkpoint=True)
    assert target.read_text() == before


def test_the_helpers_never_follow_a_link(tmp_path):
    target = _outside_file(tmp_path)
    appended, whole = tmp_path / "hang-stacks-rank0.txt", tmp_path / "nan_guard_state.json"
    appended.symlink_to(target)
    whole.symlink_to(target)
    with pytest.raises(FileExistsError, match="is a symbolic link"):
        open_append_no_follow(str(appended))
    write_text_no_follow(str(whole), "{}")
    assert target.read_text() == "untouched\n" and whole.read_text() == "{}" and not whole.is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["hang-stacks-rank0.txt", "nan_guard_state.json", "someone_elses.txt"]


def test_an_output_dir_that_is_a_link_works_and_its_target_is_fsynced_at_publication(toy_models, tmp_path, monkeypatch):
    real = tmp_path / "scratch" / "run"
    real.mkdir(parents=True)
    out = tmp_path / "out"
    out.symlink_to(real, target_is_directory=True)  # a common, legitimate layout: no false alarm
    synced, fsync = [], os.fsync

    def recording_fsync(fd):  # the real fsync, recording what it flushed
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", save_steps=2, max_steps=2).train()
    assert checkpoint_steps(str(real)) == [2] and not (real / STAGING_DIR).exists()
    assert str(real) in synced  # the rename that published checkpoint-2 is durable (it was skipped behind the link)


def test_checkpoints_record_the_runs_save_total_limit(toy_models, tmp_path):
    out = tmp_path / "out"
    build_trainer(
        "dpo", toy_models["qwen2"], out, preset="guarded", save_steps=2, max_steps=2, save_total_limit=3
    ).train()  # fmt: skip
    saved = torch.load(out / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert saved.save_total_limit == 3  # what the run used, not the `None` set while the Trainer wrote in staging


@pytest.mark.parametrize("planted", ["dangling link", "link to a directory", "file"])
def test_what_is_at_a_checkpoints_name_is_replaced_never_followed(toy_models, tmp_path, planted):
    elsewhere = _someone_elses_checkpoints(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    name = out / "checkpoint-2"
    if planted == "file":
        name.write_text("not a checkpoint")
    else:
        gone = planted == "dangling link"
        name.symlink_to(tmp_path / "purged" if gone else elsewhere / "checkpoint-1", target_is_directory=True)
    build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", save_steps=2, max_steps=2).train()
    assert name.is_dir() and not name.is_symlink() and (name / "trainer_state.json").is_file()
    assert (elsewhere / "checkpoint-1" / "weights.bin").read_text() == "precious"
    assert not (out / STAGING_DIR).exists()
