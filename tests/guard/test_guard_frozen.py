"""Frozen parameters (`safe_trainers.guard.rollback.frozen`): checked, never copied into the snapshot, and when damaged
restored from their files only where the files hold them, or the run stops naming them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

from safe_trainers.errors import TrainingDivergedError
from safe_trainers.guard import read_events
from safe_trainers.runtime.finite import CHUNK_BYTES
from safe_trainers.guard.rollback.frozen import file_keys, repair_frozen, source_matches
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault, first_frozen_matrix


LORA = {"peft_config": LoraConfig(target_modules=["q_proj", "v_proj"], r=4)}
BASE_NAME = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
FILE_KEY = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    "name,keys",
    [
        ("model.embed_tokens.weight", ["model.embed_tokens.weight"]),
        (BASE_NAME, [BASE_NAME, FILE_KEY]),
        ("base_model.model.score.original_module.weight",
         ["base_model.model.score.original_module.weight", "score.weight"]),
    ],
)  # fmt: skip
def test_a_parameter_is_looked_up_by_its_own_name_then_without_the_peft_wrappers(name, keys):
    assert file_keys(name) == keys


@pytest.mark.parametrize(
    "equal,finite,numel,matches",
    [(10, 10, 10, True), (6, 6, 10, True), (9, 10, 10, False), (4, 4, 10, False), (0, 0, 10, False)],
)
def test_a_file_is_the_source_only_if_it_agrees_on_enough_finite_values(equal, finite, numel, matches):
    assert source_matches(equal, finite, numel) is matches


@pytest.mark.parametrize("rollback_from", ["memory", "checkpoint"])
def test_a_damaged_frozen_base_weight_is_restored_from_the_model_files(toy_models, tmp_path, rollback_from):
    model = toy_models["qwen2"]
    trainer = build_trainer(
        "dpo", model, tmp_path, preset="guarded", faults=[Fault(5, "frozen")], trainer_kwargs=LORA,
        nan_rollback_from=rollback_from,
    )  # fmt: skip
    trainer.train()
    assert trainer.fault_injector.injected == [(5, "frozen")]
    events = read_events(str(tmp_path))
    assert [(e["step"], e["kind"]) for e in events] == [(5, "skip"), (5, "rollback")]
    assert events[1]["reason"] == "nonfinite_state"
    weight = dict(trainer.model.named_parameters())[BASE_NAME]
    assert not weight.requires_grad and torch.equal(weight.detach(), load_file(f"{model}/model.safetensors")[FILE_KEY])
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    assert trainer.state.global_step == 10
    if rollback_from == "memory":  # the snapshot never held the base
        assert BASE_NAME not in trainer.nan_guard.snapshotter.snapshot.params


def test_a_base_changed_in_memory_is_never_replaced_from_the_files(toy_models, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"])
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(2)  # e.g. an adapter merged in before this run
    trainer = build_trainer("dpo", model, tmp_path, preset="guarded", faults=[Fault(5, "frozen")], trainer_kwargs=LORA)
    with pytest.raises(TrainingDivergedError, match=f"frozen parameter\\(s\\) `{BASE_NAME}` hold NaN or Inf"):
        trainer.train()
    assert trainer.state.global_step == 5


def _head_only(path: str) -> tuple[torch.nn.Module, torch.nn.Parameter, str]:
    """The model at `path` with all but its head and norms frozen, its first frozen matrix, and that matrix's name."""
    model = AutoModelForCausalLM.from_pretrained(path)
    for name, param in model.named_parameters():
        param.requires_grad_("lm_head" in name or "norm" in name)
    weight = first_frozen_matrix(model)
    return model, weight, next(n for n, p in model.named_parameters() if p is weight)


def test_the_newest_verified_checkpoint_that_holds_it_comes_first(toy_models, tmp_path):
    model, weight, name = _head_only(toy_models["qwen2"])
    with torch.no_grad():
        weight.mul_(3)  # no longer what the model's files hold
    expected = weight.detach().clone()
    model.save_pretrained(tmp_path / "checkpoint-4")  # what this run's verified checkpoint holds
    with torch.no_grad():
        weight.view(-1)[:5] = float("nan")
    assert repair_frozen(model, [str(tmp_path / "gone"), str(tmp_path / "checkpoint-4")], step=6) == [name]
    assert torch.equal(weight.detach(), expected)
    assert repair_frozen(model, [], step=6) == []  # nothing damaged: nothing to do


@pytest.mark.parametrize("damage", ["all", "half_and_one"])
def test_too_little_left_to_verify_a_source_stops_the_run(toy_models, tmp_path, damage):
    model, weight, name = _head_only(toy_models["qwen2"])
    with torch.no_grad():
        flat = weight.view(-1)
        flat[: flat.numel() if damage == "all" else flat.numel() // 2 + 1] = float("inf")
    with pytest.raises(TrainingDivergedError, match=f"`{name}`") as error:
        repair_frozen(model, [], step=3)
    assert "Training stopped at step 3" in str(error.value) and toy_models["qwen2"] in str(error.value)


class _UnfreezeAt(TrainerCallback):
    """Gradual unfreezing: at the start of step `step`, `param` (already in the optimizer) becomes trainable."""

    def __init__(self, param: torch.nn.Parameter, step: int):
        self.param, self.step = param, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self.param.requires_grad_(True)


@pytest.mark.parametrize("rollback_from", ["memory", "checkpoint"])
def test_a_parameter_unfrozen_after_the_last_snapshot_is_checked_after_a_restore(toy_models, tmp_path, rollback_from):
    # The snapshot of step 4 does not hold the weight (frozen then); unfrozen and trained at step 5, it is damaged at
    # step 6. From memory the restore cannot put it back and its trained values are no longer the files': the run
    # stops there naming it (it went on from a "restored" state still holding NaN, and its abort could not save).
    # From disk, checkpoint-4 holds every weight of this full model: the restore puts it back and training goes on.
    model, weight, name = _head_only(toy_models["qwen2"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # every parameter: the frozen ones get no gradient
    trainer = build_trainer(
        "sft", model, tmp_path, preset="guarded", faults=[Fault(6, "frozen")], nan_rollback_from=rollback_from,
        trainer_kwargs={"optimizers": (optimizer, None)},
    )  # fmt: skip
    trainer.add_callback(_UnfreezeAt(weight, step=5))
    if rollback_from == "memory":
        with pytest.raises(TrainingDivergedError, match=f"`{name}`") as error:
            trainer.train()
        message = str(error.value)
        assert "Training stopped at step 6" in message and "unfrozen since the last snapshot" in message
        assert name not in trainer.nan_guard.snapshotter.snapshot.params
    else:
        trainer.train()
        events = read_events(str(tmp_path))
        assert [(e["step"], e["kind"]) for e in events] == [(6, "skip"), (6, "rollback")]
        assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
        assert trainer.state.global_step == 10
    assert trainer.fault_injector.injected == [(6, "frozen")] and weight.requires_grad


PEAK_REPAIR = """
import json, os, sys, tempfile, threading, time, torch
from safetensors.torch import save_file
from safe_trainers.guard.rollback.frozen import SafetensorsIndex
torch.set_num_threads(1)

def anon():  # the process's anonymous memory now (the file's pages, read through a mapping, are not counted)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))

folder = tempfile.mkdtemp()
weight = torch.empty(2**13, 2**14, dtype=torch.bfloat16).uniform_(-1, 1)  # 256 MiB
save_file({"w": weight}, os.path.join(folder, "model.safetensors"))
param = torch.nn.Parameter(weight, requires_grad=False)
expected = weight[-1, -4:].clone()
with torch.no_grad():
    param[-1, -4:] = float("nan")
index, base, peak, done = SafetensorsIndex(folder), anon(), [0], threading.Event()

def watch():
    while not done.is_set():
        peak[0] = max(peak[0], anon() - base)
        time.sleep(0.0005)

watcher = threading.Thread(target=watch)
watcher.start()
restored = index.restore("w", param)
done.set()
watcher.join()
print(json.dumps({"restored": restored and torch.equal(param[-1, -4:], expected), "extra": peak[0]}))
"""


@pytest.mark.slow  # a process of its own, or a real run
def test_a_repair_reads_the_file_in_pieces_and_holds_no_whole_copy():
    # A fresh process watching its anonymous memory: the repair before this one loaded the file's whole tensor and
    # made a second copy of it on the parameter's device (2x a 256 MiB weight here; on a GPU, device memory).
    done = subprocess.run([sys.executable, "-c", PEAK_REPAIR], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["restored"]
    assert result["extra"] <= CHUNK_BYTES + 16 * 2**20, result
