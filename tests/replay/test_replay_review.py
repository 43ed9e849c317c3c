"""Review of the replay bundles (docs/replay.md): what the extra diagnosis of every faulted inspection must not
change, and the edges of the bundles on disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from net_utils import EXIT_RACE, free_port
from transformers import TrainerCallback

from safe_trainers.cli.main import main
from safe_trainers.guard import read_events
from safe_trainers.replay import bundle_steps, fit, read_bundle, write_bundle

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.testing.toy import save_toy_model


def _final_weights(model: str, out: str, **config) -> dict[str, torch.Tensor]:
    faults = [Fault(step=3, kind="loss"), Fault(step=7, kind="loss")]  # two inspections that find a fault
    trainer = build_trainer("sft", model, out, preset="guarded", faults=faults, bf16=False, **config)
    trainer.train()
    assert trainer.state.global_step == 10
    return {name: p.detach().clone() for name, p in trainer.model.state_dict().items()}


def test_the_diagnosis_forward_draws_nothing_from_the_random_generators(tmp_path):
    """With dropout, a diagnosis forward that drew from the generator would train the steps after it on other masks:
    the run with bundles (a diagnosis at steps 3 and 7) ends on the same weights, bit for bit, as the run without
    (one diagnosis, at step 3)."""
    model = save_toy_model(str(tmp_path / "model"), "qwen2", attention_dropout=0.3)
    with_bundles = _final_weights(model, str(tmp_path / "bundles"))
    without = _final_weights(model, str(tmp_path / "none"), nan_replay_max_bytes=0)
    assert with_bundles.keys() == without.keys()
    differ = [name for name in with_bundles if not torch.equal(with_bundles[name], without[name])]
    assert differ == []


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "workers", "guard_worker.py")


def launch(launcher: list[str], tmp_path, *worker_args: str) -> str:
    """Train the guard worker's DPO run on two CPU ranks; returns its `output_dir`."""
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out = str(tmp_path / "out")
    command = launcher + [WORKER, "--kind", "dpo", "--model", model, "--out", out, *worker_args]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    finished = all(os.path.exists(os.path.join(out, f"result-rank{rank}.json")) for rank in (0, 1))
    assert done.returncode == 0 or (EXIT_RACE in done.stderr and finished), (done.stdout + done.stderr)[-4000:]
    return os.path.join(out, "run")


ACCELERATE_DDP = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip


@pytest.mark.distributed
def test_a_fault_on_rank_1_only_is_replayed_from_rank_1s_file(tmp_path, capsys):
    """DDP on two CPU ranks, NaN in rank 1's second micro-batch of step 3 only: rank 1 writes its own file, with the
    test fault that fired there (rank 0's injector never fired it), and the replay re-arms it and agrees."""
    run = launch(ACCELERATE_DDP + ["--main_process_port", str(free_port())], tmp_path, "--fault", "loss:3:1:nan:1",
                 "--ga", "2", "--save_steps", "2", "--max_steps", "4")  # fmt: skip
    assert bundle_steps(run) == [3]
    meta, _, payload = read_bundle(run, 3)  # rank 1's file: the rank the meta lists
    assert meta["ranks"] == [1] and meta["faults"] == []  # rank 0's view: nothing fired there
    assert [(f["kind"], f["rank"], f["micro_batch"]) for f in payload["faults"]] == [("loss", 1, 1)]
    assert main(["replay", run, "--step", "3"]) == 0
    text = capsys.readouterr().out
    assert "re-armed test faults: Fault(step=3, kind='loss', micro_batch=1)" in text
    assert "micro-batch 1 of 2" in text and "agrees with the in-loop diagnosis: yes" in text, text


def test_the_bound_counts_the_text_of_a_poisoned_online_steps_rows():
    """A poisoned GRPO/RLOO step's batch is the dataset's rows (prompts as text): over the bound, it is left out like
    a tensor would be, not written whole at 0 bytes."""
    rows = [{"prompt": "word " * 20_000} for _ in range(4)]  # 400 kB of text
    kept, sizes, left_out = fit([("micro_batch.0", rows), ("rewards", torch.zeros(4))], 1000)
    assert list(kept) == ["rewards"] and left_out == {"micro_batch.0": 400_000} and sizes == {"rewards": 16}


def test_the_replay_of_a_lora_run_loads_the_adapter_on_its_base(toy_models, tmp_path, capsys):
    """A PEFT run's checkpoints hold the adapter only (no `config.json`): the replay loads it on its base model, under
    the run's names, and agrees with the in-loop diagnosis for the activation fault and the NaN adapter weight."""
    from peft import LoraConfig

    out = str(tmp_path)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = build_trainer("sft", toy_models["qwen2"], out, preset="guarded", bf16=False, max_steps=6, save_steps=2,
                            faults=[Fault(step=3, kind="loss"), Fault(step=6, kind="weight")],
                            trainer_kwargs={"peft_config": lora})  # fmt: skip
    trainer.train()
    assert bundle_steps(out) == [3, 6]
    for step in (3, 6):
        code = main(["replay", out, "--step", str(step)])
        text = capsys.readouterr().out
        assert code == 0 and "agrees with the in-loop diagnosis: yes" in text, text
        assert "replay:  first non-finite module: base_model.model.model.layers." in text
    assert "non-finite state written over the checkpoint: base_model.model.model.layers.0.self_attn.q_proj.lora_A" \
        in text  # fmt: skip


@pytest.mark.distributed
def test_zero3_the_rank_that_shows_a_shared_damaged_weight_writes_its_rows(tmp_path, capsys):
    """ZeRO-3 on two CPU ranks, a NaN in rank 0's fp32 master shard at step 6 (its first entry: a token's embedding
    row). Gathered, every rank holds it; no loss went non-finite (a `rollback` only), and the in-loop diagnosis found
    it in rank 1's rows: rank 1 writes them, and the replay reads them and agrees."""
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps({
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True}, "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    }))  # fmt: skip
    launcher = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", "2", "--master_port", str(free_port())]
    run = launch(launcher, tmp_path, "--fault", "weight:6:0", "--deepspeed", str(config))
    meta, _, payload = read_bundle(run, 6)
    assert meta["events"] == ["rollback"] and meta["ranks"] == []
    assert meta["in_loop_diagnosis"]["rank"] == 1 and os.path.exists(os.path.join(run, "nan_replay/step-6/rank-1.pt"))
    assert main(["replay", run, "--step", "6"]) == 0
    text = capsys.readouterr().out
    assert "agrees with the in-loop diagnosis: yes" in text, text


def test_a_checkpoint_without_loadable_weights_exits_2(tmp_path, capsys):
    """A ZeRO-3 run saved without `stage3_gather_16bit_weights_on_model_save` leaves checkpoints holding the engine's
    shards only: the replay says so and exits 2 (it raised transformers' `OSError`)."""
    out = str(tmp_path)
    os.makedirs(os.path.join(out, "checkpoint-2", "global_step2"))
    write_bundle(out, 3, 0, {"micro_batches": {}}, {"step": 3, "kind": "dpo"}, {})
    assert main(["replay", out, "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint-2` holds no model weights" in err and "stage3_gather_16bit_weights_on_model_save" in err


@pytest.fixture(scope="module")
def grpo_state_check_run(toy_models, tmp_path_factory) -> str:
    """GRPO whose first trainable weight is made NaN at the start of step 6: the check before step 6's generation
    finds it (global step 5), with no step's loss non-finite: a `rollback` with no fault step."""
    out = str(tmp_path_factory.mktemp("grpo-state-check"))
    trainer = build_trainer("grpo", toy_models["qwen2"], out, preset="guarded", bf16=False, max_steps=7, save_steps=2,
                            faults=[Fault(step=6, kind="weight")])  # fmt: skip
    trainer.train()
    return out


def test_a_grpo_rollback_found_before_a_generation_has_a_bundle(grpo_state_check_run):
    """The bundle is numbered by the step the damage was found at, as the `rollback` event is; it holds the
    non-finite entries, the last generation's rewards and the weight fault that fired at the step in progress, and
    no micro-batches (which step damaged the weights is unknown: the meta says so)."""
    out = grpo_state_check_run
    events = read_events(out)
    assert [(e["step"], e["kind"]) for e in events] == [(5, "rollback")]
    assert events[0]["fault_step"] is None
    assert bundle_steps(out) == [5]
    meta, _, payload = read_bundle(out, 5)
    assert meta["events"] == ["rollback"] and meta["ranks"] == [] and meta["checkpoint"] == "checkpoint-4"
    assert (meta["found_by"], meta["fault_step"], meta["damaged_ranks"]) == ("state_check", None, [0])
    assert "which step damaged them is unknown" in meta["note"]
    assert meta["micro_batches"] == 0 and payload["micro_batches"] == {} and meta["in_loop_diagnosis"] is None
    (name, entry), = payload["state"].items()  # the NaN weight, as its non-finite entries
    assert meta["nonfinite_state"] == [name] and entry["index"].tolist() == [0] and entry["value"].isnan().all()
    assert payload["rewards"] is not None and payload["rewards"].shape[1] == len(meta["reward_funcs"]) >= 1
    assert [(f["step"], f["kind"]) for f in meta["faults"]] == [(6, "weight")] == \
        [(f["step"], f["kind"]) for f in payload["faults"]]  # fmt: skip


def test_the_replay_of_a_bundle_without_micro_batches_writes_the_entries_and_exits_3(grpo_state_check_run, capsys):
    """Nothing to replay forward: the checkpoint is loaded, the damaged entries written over it and listed, and the
    replay says there is no forward to run, with exit status 3 (docs/replay.md)."""
    meta, _, payload = read_bundle(grpo_state_check_run, 5)
    (name,) = payload["state"]
    assert main(["replay", grpo_state_check_run, "--step", "5"]) == 3
    text = capsys.readouterr().out
    assert "Replay of step 5 (rollback; " in text and "from checkpoint-4 on the CPU" in text, text
    assert f"non-finite state written over the checkpoint: {name}" in text
    assert f"non-finite entries of {name} (" in text and "1 NaN, 0 Inf) at flat indices [0]" in text
    assert "test fault not re-armed: Fault(step=6, kind='weight') (no forward runs" in text
    assert "nothing to replay forward: the bundle holds no micro-batches" in text
    assert "which step damaged it is unknown" in text and "first non-finite module" not in text


def test_args_json_hides_a_token_inside_any_text():
    """`args.json` hides credentials by name and by shape, also inside a longer text or a nested mapping."""
    from safe_trainers import DPOConfig
    from safe_trainers.trainer.replay_bundles import config_record

    token = "hf_" + "a1B2" * 9
    config = DPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", hub_token=token,
                       run_name=f"run with {token}", model_init_kwargs={"token": "plain", "note": f"see {token}"})
    text = json.dumps(config_record(config), default=str)
    assert token not in text and "plain" not in text and "run with <hidden>" in text


class _AdamMomentNaN(TrainerCallback):
    """Makes one entry of the first parameter's `exp_avg_sq` NaN at the start of step `at` (the weights stay finite):
    the check before that step's generation finds the optimizer state damaged, with no step's loss non-finite."""

    def __init__(self, at: int):
        self.at = at

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step + 1 == self.at:
            param = next(p for group in optimizer.param_groups for p in group["params"] if optimizer.state.get(p))
            optimizer.state[param]["exp_avg_sq"].view(-1)[0] = float("nan")


def test_an_optimizer_state_only_damage_is_named_in_the_bundle_and_the_replay(toy_models, tmp_path, capsys):
    """Adam's moments NaN, the weights finite: the bundle has no weight entry to write, and says so honestly: the
    meta names the optimizer state found non-finite (not kept: a forward does not read it) and the replay lists it
    (it printed `non-finite state written over the checkpoint: none` and nothing else about the damage)."""
    out = str(tmp_path)
    trainer = build_trainer("grpo", toy_models["qwen2"], out, preset="guarded", bf16=False, max_steps=6, save_steps=2)
    trainer.add_callback(_AdamMomentNaN(6))
    trainer.train()
    assert [(e["step"], e["kind"], e["fault_step"]) for e in read_events(out)] == [(5, "rollback", None)]
    meta, _, payload = read_bundle(out, 5)
    assert meta["nonfinite_state"] == [] and payload["state"] == {}
    (name, entry), = meta["nonfinite_optimizer_state"].items()
    assert name.endswith(".weight:exp_avg_sq") and (entry["nonfinite"], entry["nan"]) == (1, 1)
    assert main(["replay", out, "--step", "5"]) == 3
    text = capsys.readouterr().out
    assert f"non-finite optimizer state (not in the bundle: a forward does not read it): {name} (" in text, text


class _WeightNaNAfterTheGuard(TrainerCallback):
    """Writes NaN into the first trainable weight at the end of step `at`, after the guard's own check of that step
    (a callback added after it): the check before the step's save finds it, with no step left to judge."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).view(-1)[0] = float("nan")


def test_an_offline_rollback_found_by_the_check_before_a_save_has_a_bundle_that_says_so(toy_models, tmp_path, capsys):
    """DPO takes the state-check path too: the check before a save finds the weights damaged after the step's own
    check, a `rollback` with no fault step. Its bundle is numbered by the rollback's step, holds the entries, and its
    note names the checks that find such damage (it said `GRPO/RLOO: before a generation` only, and the docs said
    only GRPO/RLOO take this path)."""
    out = str(tmp_path)
    trainer = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", bf16=False, max_steps=5, save_steps=2)
    trainer.add_callback(_WeightNaNAfterTheGuard(4))
    trainer.train()
    assert [(e["step"], e["kind"], e["fault_step"]) for e in read_events(out)] == [(4, "rollback", None)]
    assert bundle_steps(out) == [4]
    meta, _, payload = read_bundle(out, 4)
    assert (meta["found_by"], meta["micro_batches"], meta["checkpoint"]) == ("state_check", 0, "checkpoint-2")
    assert list(payload["state"]) == meta["nonfinite_state"] and len(meta["nonfinite_state"]) == 1
    assert "before a save or an evaluation" in meta["note"], meta["note"]
    assert main(["replay", out, "--step", "4"]) == 3
    assert "nothing to replay forward" in capsys.readouterr().out


def test_the_replay_of_a_poisoned_online_step_runs_no_forward_and_exits_3(tmp_path, capsys):
    """A poisoned GRPO/RLOO step's bundle holds prompts only: no forward runs, so the replay exits 3 and says there
    is nothing to replay forward (it exited 0, as if a replay had run, and printed `no module output went
    non-finite`)."""
    out = str(tmp_path)
    os.makedirs(os.path.join(out, "checkpoint-2"))
    open(os.path.join(out, "checkpoint-2", "model.safetensors"), "wb").close()  # never read: no trainer is built
    meta = {"step": 3, "events": ["skip", "poison"], "kind": "grpo", "trainer_class": "GRPOTrainer",
            "prepared": False, "micro_batches": 1}  # fmt: skip
    write_bundle(out, 3, 0, {"micro_batches": {0: [{"prompt": "a"}]}, "state": {}, "faults": []}, meta, {})
    assert main(["replay", out, "--step", "3"]) == 3
    text = capsys.readouterr().out
    assert "nothing to replay forward: a poisoned GRPO/RLOO step holds its prompts only" in text, text
    assert "first non-finite module" not in text
