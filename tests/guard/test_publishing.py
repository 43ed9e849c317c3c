"""`restarts/publishing.py`: a crash at any point of publishing `checkpoint-N` over an older copy leaves a complete
copy, which the recovery at the next start keeps and `resume_from_checkpoint=True` resumes from. Real checkpoints of a
real run; one test kills a real training process between the steps of a publication.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys

import pytest
from guard_utils import checkpoint_steps

from safe_trainers.runtime.checkpoint_dirs import STAGING_DIR, checkpoint_dir, staging_run_dir
from safe_trainers.restarts.publishing import (
    PUBLISH_STEPS, Found, Publication, publish, recover_staging, recovery_actions,
)  # fmt: skip
from safe_trainers.restarts.checkpoint_choice import checkpoint_problem, choose_checkpoint
from safe_trainers.restarts.resume_plan import this_launchs
from safe_trainers.restarts.progress import read_progress
from safe_trainers.testing.build import build_trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW = "written_by_the_new_save.txt"  # marks the staged (new) copy of checkpoint-4


@pytest.fixture(scope="module")
def finished_run(toy_models, tmp_path_factory) -> str:
    """A real run with checkpoint-2 and checkpoint-4."""
    out = tmp_path_factory.mktemp("run")
    build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", save_steps=2, max_steps=4).train()
    assert checkpoint_steps(str(out)) == [2, 4]
    return str(out)


def _crash_after(run_dir: str, k: int, damage: str | None = None) -> Publication:
    """Stage a new copy of checkpoint-4, run the first `k` publish steps, then "die" (leaving `damage`)."""
    p = Publication(checkpoint_dir(staging_run_dir(run_dir), 4), checkpoint_dir(run_dir, 4))
    os.makedirs(p.staging)
    shutil.copytree(p.final, p.staged)
    with open(os.path.join(p.staged, NEW), "w") as f:
        f.write("new")
    if damage == "half_written":  # died while the Trainer was writing the staged copy
        os.remove(os.path.join(p.staged, "model.safetensors"))
    for step in PUBLISH_STEPS[:k]:
        step(p)
    if damage == "half_deleted_aside":  # died in the clean-up, while deleting the replaced copy
        os.unlink(p.marker)
        os.remove(os.path.join(p.aside, "model.safetensors"))
    return p


CRASHES = [(k, None) for k in range(len(PUBLISH_STEPS) + 1)] + [(0, "half_written"), (3, "half_deleted_aside")]


@pytest.mark.parametrize("k,damage", CRASHES)
def test_a_crash_at_any_point_of_a_publication_leaves_a_complete_checkpoint(finished_run, tmp_path, k, damage):
    run_dir = str(tmp_path / "out")
    shutil.copytree(finished_run, run_dir)
    _crash_after(run_dir, k, damage)
    recover_staging(run_dir)
    final = checkpoint_dir(run_dir, 4)
    assert checkpoint_problem(final) is None  # complete and finite
    sealed = k >= 1 and damage != "half_written"
    assert os.path.exists(os.path.join(final, NEW)) == sealed  # the new copy once sealed, else the old one
    assert not os.path.exists(staging_run_dir(run_dir)) and checkpoint_steps(run_dir) == [2, 4]
    assert choose_checkpoint(run_dir).path == final  # what `resume_from_checkpoint=True` takes


def _complete_copies(found: Found, actions: tuple[str, ...]) -> int:
    """How many complete copies of checkpoint-N are left once `actions` ran on what `found` says is there."""
    published = found.published or "restore_aside" in actions or ("publish" in actions and not found.damaged)
    kept_staged = found.staged and "discard_staged" not in actions and "publish" not in actions
    kept_aside = found.aside and "discard_aside" not in actions and "restore_aside" not in actions
    return published + kept_aside + kept_staged


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=5)))
def test_recovery_never_removes_the_last_complete_copy(flags):
    found = Found(*flags)
    actions = recovery_actions(found)
    usable = found.staged and found.complete and not found.damaged
    had = found.published or found.aside or usable
    if had:
        assert _complete_copies(found, actions) >= 1
    assert not (usable and "discard_staged" in actions)
    assert "discard_aside" not in actions or found.published  # a replaced copy goes only when checkpoint-N is there


def test_publish_replaces_an_older_copy_and_leaves_nothing_behind(tmp_path):
    run_dir = str(tmp_path)
    staged, final = checkpoint_dir(staging_run_dir(run_dir), 4), checkpoint_dir(run_dir, 4)
    os.makedirs(staged)
    (tmp_path / STAGING_DIR / "checkpoint-4" / "model.safetensors").write_text("new")
    os.makedirs(final)
    (tmp_path / "checkpoint-4" / "stale.bin").write_text("old")
    publish(staged, final)
    assert sorted(os.listdir(final)) == ["model.safetensors"] and not os.path.exists(tmp_path / STAGING_DIR)


KILL_SCRIPT = r"""
import os, sys
from safe_trainers.restarts import publishing
from safe_trainers.testing.build import build_trainer

out = {out!r}
trainer = build_trainer("dpo", {model!r}, out, preset="guarded", save_steps=2, max_steps=4)
def die(publication):
    os._exit(9)  # killed between two steps of publishing checkpoint-4 over the older copy
publishing.PUBLISH_STEPS = publishing.PUBLISH_STEPS[:{k}] + (die,)
trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
"""


@pytest.mark.parametrize("k", [1, 2])  # sealed, not set aside; set aside, not moved in (checkpoint-4 missing)
def test_a_run_killed_while_replacing_a_checkpoint_resumes_from_it(toy_models, finished_run, tmp_path, k):
    out = str(tmp_path / "out")
    shutil.copytree(finished_run, out)
    script = KILL_SCRIPT.format(out=out, model=toy_models["qwen2"], k=k)
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr[-3000:]
    assert os.path.isdir(checkpoint_dir(out, 4)) == (k < 2)  # the kill happened between the steps

    first_steps = []

    class FirstStep(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            first_steps.append(state.global_step)

    trainer = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", save_steps=2, max_steps=6)
    trainer.add_callback(FirstStep())
    trainer.train(resume_from_checkpoint=True)
    assert first_steps[0] == 5 and trainer.state.global_step == 6  # resumed from checkpoint-4
    assert checkpoint_steps(out) == [2, 4, 6] and not os.path.exists(staging_run_dir(out))


@pytest.mark.parametrize("k", [1, 2])  # sealed, checkpoint-4 still there; sealed and the old copy set aside
def test_a_sealed_copy_damaged_since_never_replaces_a_complete_one(finished_run, tmp_path, k):
    run_dir = str(tmp_path / "out")
    shutil.copytree(finished_run, run_dir)
    p = _crash_after(run_dir, k)
    with open(os.path.join(p.staged, "model.safetensors"), "r+b") as f:
        f.truncate(100)  # damaged after it was sealed (a disk error, a stray write)
    lines = recover_staging(run_dir)
    final = checkpoint_dir(run_dir, 4)
    assert checkpoint_problem(final) is None and not os.path.exists(os.path.join(final, NEW))  # the old copy
    assert choose_checkpoint(run_dir).path == final and not os.path.exists(staging_run_dir(run_dir))
    assert any("model.safetensors" in line and p.staged in line for line in lines)  # says why


RECORD_SCRIPT = r"""
import os
from safe_trainers.trainer import checkpoints
from safe_trainers.testing.build import build_trainer

def die(*args, **kwargs):
    os._exit(9)  # killed once checkpoint-4 is published, while older ones are rotated (or uploaded)
checkpoints.rotate_up_to = die
build_trainer("dpo", {model!r}, {out!r}, preset="guarded", save_steps=2, max_steps=4).train()
"""


def test_a_checkpoint_is_in_the_step_record_as_soon_as_it_is_published(toy_models, tmp_path):
    out = str(tmp_path / "out")
    script = RECORD_SCRIPT.format(out=out, model=toy_models["qwen2"])
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 9 and checkpoint_steps(out) == [2], done.stderr[-3000:]
    record = read_progress(out)
    assert record.history.checkpoints == (2,)  # a restart of the launch resumes from it, not from the start
    assert this_launchs(record)(checkpoint_dir(out, 2)) is None
