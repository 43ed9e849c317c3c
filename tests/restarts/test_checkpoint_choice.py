"""`restarts/checkpoint_choice.py`: which checkpoint a resume takes (the newest complete and finite one) and why each
newer one was passed over, on small checkpoints written to disk (no trainer)."""

from __future__ import annotations

import os

from checkpoint_utils import write_checkpoint  # tests/ is on sys.path

from safe_trainers.restarts.checkpoint_choice import choose_checkpoint


def listing(run_dir: str) -> dict[str, tuple[int, int]]:
    """Every file under `run_dir`, with its size and modification time."""
    found = {}
    for root, _, files in os.walk(run_dir):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            found[os.path.join(root, name)] = (stat.st_size, stat.st_mtime_ns)
    return found


def test_the_newest_complete_and_finite_checkpoint_is_chosen_and_each_newer_one_says_why_not(tmp_path):
    run = str(tmp_path)
    good = write_checkpoint(run, 2, optimizer=0.5)
    write_checkpoint(run, 4, weight=float("nan"))
    write_checkpoint(run, 6, optimizer=float("inf"))
    write_checkpoint(run, 8, state=False)  # a save that did not finish
    truncated = write_checkpoint(run, 10)
    with open(os.path.join(truncated, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) - 4)
    choice = choose_checkpoint(run)
    assert choice.path == good
    passed = [(os.path.basename(p.path), p.reason.split(":")[0]) for p in choice.passed_over]
    assert passed == [
        ("checkpoint-10", "incomplete"), ("checkpoint-8", "incomplete"), ("checkpoint-6", "non-finite"),
        ("checkpoint-4", "non-finite"),
    ]  # fmt: skip
    reasons = {os.path.basename(p.path): p.reason for p in choice.passed_over}
    assert "`trainer_state.json`" in reasons["checkpoint-8"] and "model.safetensors" in reasons["checkpoint-10"]
    assert reasons["checkpoint-6"] == "non-finite: `state.0.exp_avg` in `optimizer.pt`"
    assert reasons["checkpoint-4"] == "non-finite: `w` in `model.safetensors`"


def test_steps_are_compared_as_numbers_and_other_directories_are_not_checkpoints(tmp_path):
    run = str(tmp_path)
    write_checkpoint(run, 9)
    newest = write_checkpoint(run, 10)
    for name in ("checkpoint-final", "runs", "checkpoint-11.tmp"):
        os.makedirs(os.path.join(run, name))
    choice = choose_checkpoint(run)
    assert choice.path == newest and choice.passed_over == ()


def test_no_usable_checkpoint_chooses_none_with_every_reason(tmp_path):
    run = str(tmp_path)
    write_checkpoint(run, 3, weight=float("nan"))
    write_checkpoint(run, 5, state=False)
    choice = choose_checkpoint(run)
    assert choice.path is None and [os.path.basename(p.path) for p in choice.passed_over] == [
        "checkpoint-5", "checkpoint-3",
    ]  # fmt: skip
    assert choose_checkpoint(str(tmp_path / "empty")).path is None  # no directory at all: nothing to choose


def test_the_choice_changes_nothing_on_disk_and_is_the_same_every_time(tmp_path):
    run = str(tmp_path)
    write_checkpoint(run, 2)
    write_checkpoint(run, 4, weight=float("nan"))
    before = listing(run)
    first, second = choose_checkpoint(run), choose_checkpoint(run)
    assert first == second and listing(run) == before


def test_a_given_problem_check_decides_what_is_passed_over(tmp_path):
    run = str(tmp_path)
    older = write_checkpoint(run, 2)
    write_checkpoint(run, 4)
    choice = choose_checkpoint(run, problem=lambda path: "not ours" if path.endswith("-4") else None)
    assert choice.path == older and [(p.reason) for p in choice.passed_over] == ["not ours"]
