"""A checkpoint the run did not write executes nothing: DeepSpeed and DCP load their pickled state with pickle's full
unpickler, so a planted `checkpoint-N` whose state carries a pickle payload is passed over by `resume_from_checkpoint=
True` (the payload never runs) and an explicit path to it is refused, naming the global; real ZeRO-2, ZeRO-3 and FSDP2
checkpoints are accepted (no false alarm: tests/restarts/test_planted_checkpoints_distributed.py).
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading

import pytest
import torch
from guard_utils import recording

from safe_trainers.guard import read_events
from safe_trainers.restarts.checkpoint_choice import choose_checkpoint, safety_problem
from safe_trainers.testing.build import build_trainer
from safe_trainers.trainers import trainer_class


class Payload:
    """Unpickled, it runs a shell command that writes `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_deepspeed(checkpoint: str, marker: str) -> str:
    """A DeepSpeed state directory, as `deepspeed_load_checkpoint` finds it, whose model states run the payload."""
    tag = os.path.join(checkpoint, "global_step9")
    os.makedirs(tag)
    state = {"module": {"w": torch.zeros(2)}, "payload": Payload(marker)}
    torch.save(state, os.path.join(tag, "mp_rank_00_model_states.pt"))
    with open(os.path.join(checkpoint, "latest"), "w") as f:
        f.write("global_step9")
    return "global_step9/mp_rank_00_model_states.pt"


def plant_dcp(checkpoint: str, marker: str) -> str:
    """A DCP directory (FSDP's `SHARDED_STATE_DICT`) whose `.metadata` runs the payload when `pickle.load` reads it."""
    directory = os.path.join(checkpoint, "pytorch_model_fsdp_0")
    os.makedirs(directory)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)
    with open(os.path.join(directory, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 64)
    return "pytorch_model_fsdp_0/.metadata"


PLANTS = {"deepspeed": plant_deepspeed, "dcp": plant_dcp}


@pytest.mark.parametrize("backend", sorted(PLANTS))
def test_a_planted_checkpoint_is_passed_over_and_runs_nothing(finished_run, toy_models, tmp_path, backend):
    reference, seen = finished_run
    out = str(tmp_path / "out")
    shutil.copytree(reference, out)
    marker = str(tmp_path / "payload-ran")
    planted = os.path.join(out, "checkpoint-9")  # complete, as the completeness check sees it
    shutil.copytree(os.path.join(out, "checkpoint-4"), planted)
    file = PLANTS[backend](planted, marker)

    choice = choose_checkpoint(out)
    assert choice.path == os.path.join(out, "checkpoint-4")
    (passed,) = choice.passed_over
    assert passed.path == planted
    assert passed.reason.startswith(f"unsafe: `{file}` needs `posix.system`"), passed.reason
    assert "`trusted_checkpoint_globals`" in passed.reason

    resumed = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=6, save_steps=2,
                            trainer_cls=recording(trainer_class("dpo")))  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    assert [step for step, _ in resumed.seen] == [5, 6]  # from checkpoint-4
    event = [e for e in read_events(out) if e["kind"] == "resume"][-1]
    assert event["checkpoint"] == os.path.join(out, "checkpoint-4") and event["passed_over"][0]["checkpoint"] == planted

    # An explicit path is the user's choice, still checked: refused with the global and the opt-in.
    explicit = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=8, save_steps=2)
    with pytest.raises(ValueError, match=r"`resume_from_checkpoint='.*checkpoint-9'` is unsafe: .* needs "
                       r"`posix.system`.*`trusted_checkpoint_globals`"):  # fmt: skip
        explicit.train(resume_from_checkpoint=planted)
    assert not os.path.exists(marker)  # nothing of the planted state ran, at any point
    assert safety_problem(os.path.join(out, "checkpoint-4")) is None


def test_latest_naming_a_tag_outside_the_checkpoint_is_refused(finished_run, tmp_path):
    reference, _ = finished_run
    checkpoint = str(tmp_path / "checkpoint-4")
    shutil.copytree(os.path.join(reference, "checkpoint-4"), checkpoint)
    os.makedirs(os.path.join(checkpoint, "global_step4"))
    (tmp_path / "elsewhere").mkdir()
    with open(os.path.join(checkpoint, "latest"), "w") as f:
        f.write("../elsewhere")
    assert safety_problem(checkpoint).startswith("unsafe: `latest` names `../elsewhere`, not a `global_step*`")


def test_latest_naming_another_tag_of_the_checkpoint_is_checked_too(finished_run, tmp_path):
    """DeepSpeed loads the tag `latest` names, whatever its name: a payload there is found, not only in
    `global_step*`."""
    reference, _ = finished_run
    out = str(tmp_path / "out")
    shutil.copytree(reference, out)
    planted = os.path.join(out, "checkpoint-9")
    shutil.copytree(os.path.join(out, "checkpoint-4"), planted)
    marker = str(tmp_path / "payload-ran")
    plant_deepspeed(planted, marker)
    os.rename(os.path.join(planted, "global_step9"), os.path.join(planted, "tag"))
    os.makedirs(os.path.join(planted, "global_step9"))  # what transformers looks for before it calls DeepSpeed
    torch.save({"module": {"w": torch.zeros(2)}}, os.path.join(planted, "global_step9", "mp_rank_00_model_states.pt"))
    with open(os.path.join(planted, "latest"), "w") as f:
        f.write("tag")
    assert safety_problem(planted).startswith("unsafe: `tag/mp_rank_00_model_states.pt` needs `posix.system`")
    with open(os.path.join(planted, "latest"), "w") as f:  # DeepSpeed reads all of it: a tag past what is read
        f.write("global_step9" + " " * 300 + "x")
    assert safety_problem(planted).startswith("unsafe: `latest` names")
    assert choose_checkpoint(out).path == os.path.join(out, "checkpoint-4")
    assert not os.path.exists(marker)


def unblock(fifo: str) -> None:
    """Let a reader blocked on `fifo` go on (it reads the end of the file)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waits on it
        pass


@pytest.mark.parametrize("place", ["global_step9/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                   "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp"])  # fmt: skip
def test_a_fifo_in_the_backend_state_is_passed_over_unread(finished_run, tmp_path, place):
    """Reading a FIFO blocks until another process writes to it (what it writes, the loader runs): the choice never
    opens one, and passes its checkpoint over (DeepSpeed and DCP would open it)."""
    reference, _ = finished_run
    out = str(tmp_path / "out")
    shutil.copytree(reference, out)
    planted = os.path.join(out, "checkpoint-9")
    shutil.copytree(os.path.join(out, "checkpoint-4"), planted)
    if place.startswith("global_step"):
        plant_deepspeed(planted, str(tmp_path / "unused"))
        torch.save({"module": {}}, os.path.join(planted, "global_step9", "mp_rank_00_model_states.pt"))
    else:
        plant_real_dcp(planted)
    fifo = os.path.join(planted, place)
    if os.path.exists(fifo):
        os.remove(fifo)
    os.mkfifo(fifo)
    result = {}
    thread = threading.Thread(target=lambda: result.update(choice=choose_checkpoint(out)), daemon=True)
    thread.start()
    thread.join(60)
    blocked = thread.is_alive()
    unblock(fifo)
    thread.join()
    assert not blocked, f"the checkpoint choice blocked opening `{place}`"
    choice = result["choice"]
    assert choice.path == os.path.join(out, "checkpoint-4")
    assert f"`{place}` is not a regular file" in choice.passed_over[0].reason, choice.passed_over[0].reason


def plant_real_dcp(checkpoint: str) -> None:
    """A DCP directory as FSDP's `SHARDED_STATE_DICT` writes it, with a non-tensor item (loaded with pickle)."""
    import torch.distributed.checkpoint as dcp

    directory = os.path.join(checkpoint, "pytorch_model_fsdp_0")
    dcp.save({"model": {"w": torch.zeros(2), "step": 3}}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
