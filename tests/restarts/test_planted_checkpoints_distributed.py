"""Real DeepSpeed ZeRO-2/ZeRO-3 and FSDP2 (DCP) checkpoints, saved and resumed by two CPU ranks: the allowlist of the
classes those backends store accepts them (no false alarm), and a planted newer checkpoint whose pickled state would
run a payload in DeepSpeed's or DCP's loader is passed over: the payload never runs, the resume takes the real one.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch
from test_guard_distributed import ZERO3, deepspeed_launcher, launch
from test_guard_fsdp2 import torchrun

from safe_trainers.guard import read_events


pytestmark = pytest.mark.distributed


class Payload:
    """Unpickled, it runs a shell command that writes `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_in_deepspeed_state(checkpoint: str, marker: str) -> str:
    """Rank 0's ZeRO optimizer states (loaded by both stages with `weights_only=False`) carry the payload."""
    name = "global_step2/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {}, "payload": Payload(marker)}, os.path.join(checkpoint, name))
    return f"`{name}` needs `posix.system`"


def plant_in_dcp_item(checkpoint: str, marker: str) -> str:
    """The DCP optimizer's `.metadata` stays clean (only allowlisted classes) but stores one non-tensor item, which
    DCP loads with `weights_only=False`, in a new file holding the payload."""
    directory = os.path.join(checkpoint, "optimizer_0")
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # the real file this test's own run wrote
    index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    with open(os.path.join(directory, "__2_0.distcp"), "wb") as f:
        f.write(payload.getvalue())
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)("__2_0.distcp", 0, len(payload.getvalue()))
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return "`optimizer_0/__2_0.distcp` item `optimizer.param_groups.0.lr` needs `posix.system`"


def zero(stage: int, tmp_path) -> list[str]:
    config = tmp_path / f"zero{stage}.json"
    settings = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    config.write_text(json.dumps({**ZERO3, "zero_optimization": settings}))
    return ["--deepspeed", str(config)]


BACKENDS = {
    "zero2": (deepspeed_launcher, lambda tmp: zero(2, tmp), plant_in_deepspeed_state),
    "zero3": (deepspeed_launcher, lambda tmp: zero(3, tmp), plant_in_deepspeed_state),
    "fsdp2": (torchrun, lambda tmp: ["--fsdp", "SHARDED_STATE_DICT"], plant_in_dcp_item),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_real_checkpoint_is_accepted_and_a_planted_one_runs_nothing(tmp_path, backend):
    launcher, options, plant = BACKENDS[backend]
    extra = options(tmp_path)
    launch(launcher(), "dpo", [], tmp_path, *extra, "--max_steps", "2", "--save_steps", "2")
    run = tmp_path / "out" / "run"
    planted = str(run / "checkpoint-9")
    shutil.copytree(run / "checkpoint-2", planted)
    marker = str(tmp_path / "payload-ran")
    expected = plant(planted, marker)

    results = launch(launcher(), "dpo", [], tmp_path, *extra, "--max_steps", "4", "--save_steps", "2",
                     "--resume", "true")  # fmt: skip
    assert not os.path.exists(marker)
    assert [r["global_step"] for r in results] == [4, 4]
    assert [[step for step, _ in r["seen"]] for r in results] == [[3, 4], [3, 4]]  # from the real checkpoint-2
    event = [e for e in read_events(str(run)) if e["kind"] == "resume"][-1]
    assert event["checkpoint"] == str(run / "checkpoint-2")
    (passed,) = event["passed_over"]
    assert passed["checkpoint"] == planted and passed["reason"].startswith(f"unsafe: {expected}"), passed["reason"]
