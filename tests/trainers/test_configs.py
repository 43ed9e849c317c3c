"""The shipped configs: accelerate and DeepSpeed files are bf16-only with "auto" clipping; every trainer config parses
with the launch scripts' parser and passes the safety rules unchanged; a bad DeepSpeed config is fixed and reported."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from net_utils import free_port

from safe_trainers.testing import toy
from safe_trainers.arguments import SafetyArguments
from safe_trainers.rules.stages import run_setup_rules
from safe_trainers.scripts.pipeline import model_and_peft, parse_args
from safe_trainers.rules.context import TrainerSetup, build_setup, load_deepspeed_config


ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
ACCELERATE = sorted((CONFIGS / "accelerate").glob("*.yaml"))
DEEPSPEED = sorted((CONFIGS / "deepspeed").glob("*.json"))
TRAINERS = sorted((CONFIGS / "trainers").glob("*.yaml"))

# config file -> (trainer kind, toy model fixture key used in place of the hub model)
TRAINER_CONFIGS = {
    "sft": ("sft", "qwen2"),
    "reward": ("reward", "qwen2-rm"),
    "reward_lora": ("reward", "qwen2-rm"),
    "dpo": ("dpo", "qwen2"),
    "dpo_gemma2": ("dpo", "gemma2"),
    "kto": ("kto", "qwen2"),
    "grpo": ("grpo", "qwen2"),
    "rloo": ("rloo", "qwen2"),
}


def load_any(path: Path):
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


def fp16_settings(node, where: str = "") -> list[str]:
    """Every setting in a parsed config that turns fp16 on (flags, mixed precision, DeepSpeed section, load dtype)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{where}.{key}" if where else str(key)
            if key == "fp16" and (value is True or (isinstance(value, dict) and value.get("enabled") is True)):
                found.append(here)
            elif key in ("mixed_precision", "dtype", "torch_dtype") and str(value).lower() in ("fp16", "float16"):
                found.append(here)
            elif key == "fp16_full_eval" and value is True:
                found.append(here)
            else:
                found += fp16_settings(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += fp16_settings(value, f"{where}[{i}]")
    return found


def test_every_config_family_is_shipped():
    assert {p.stem for p in ACCELERATE} == {"single_gpu", "multi_gpu", "deepspeed_zero2", "deepspeed_zero3", "fsdp2"}
    assert {p.stem for p in DEEPSPEED} == {"zero2", "zero3", "zero3_offload"}
    assert {p.stem for p in TRAINERS} == set(TRAINER_CONFIGS)


@pytest.mark.parametrize("path", ACCELERATE + DEEPSPEED + TRAINERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_fp16_anywhere(path):
    assert fp16_settings(load_any(path)) == []
    assert "fp16: true" not in path.read_text().lower()


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_config(path):
    config = load_config_from_file(str(path))
    assert config.mixed_precision == "bf16"
    assert config.num_machines == 1 and config.use_cpu is False
    expected = {
        "single_gpu": "NO",
        "multi_gpu": "MULTI_GPU",
        "deepspeed_zero2": "DEEPSPEED",
        "deepspeed_zero3": "DEEPSPEED",
        "fsdp2": "FSDP",
    }[path.stem]
    assert str(config.distributed_type).split(".")[-1] == expected
    if path.stem == "single_gpu":
        assert config.num_processes == 1
    if expected == "DEEPSPEED":
        ds = config.deepspeed_config
        assert ds["zero_stage"] == int(path.stem[-1])
        # Unset (or "auto") means the Trainer's `max_grad_norm`, which the safety rules keep on.
        assert ds.get("gradient_clipping", "auto") == "auto"
        assert "deepspeed_config_file" not in ds
        assert ds.get("zero3_save_16bit_model", True) is True
    if expected == "FSDP":
        # The guard protects FSDP2 only (FSDP1 is refused): the version must be stated, not left to a default.
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


@pytest.mark.parametrize("path", DEEPSPEED, ids=lambda p: p.name)
def test_deepspeed_config(path):
    config = json.loads(path.read_text())
    assert config["bf16"]["enabled"] == "auto"
    assert config.get("fp16", {}).get("enabled", "auto") in ("auto", False)
    assert config["gradient_clipping"] == "auto"
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert config[key] == "auto", key
    zero = config["zero_optimization"]
    assert zero["stage"] == int(path.stem[4])
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    offloaded = {zero.get("offload_optimizer", {}).get("device"), zero.get("offload_param", {}).get("device")}
    assert offloaded == ({"cpu"} if path.stem.endswith("offload") else {None})


@pytest.mark.parametrize("path", TRAINERS, ids=lambda p: p.name)
def test_trainer_config_starts_with_its_command(path):
    kind = TRAINER_CONFIGS[path.stem][0]
    first = path.read_text().splitlines()[0]
    assert first.startswith("# accelerate launch --config_file configs/accelerate/"), first
    words = first[2:].split()
    assert (ROOT / words[words.index("--config_file") + 1]).is_file()
    assert words[words.index("--config_file") + 2] == f"launch/train_{kind}.py"
    assert (ROOT / f"launch/train_{kind}.py").is_file()
    assert words[words.index("--config") + 1] == f"configs/trainers/{path.name}"


def pre_construction_setup(kind: str, script_args, args, model_args) -> TrainerSetup:
    """The `TrainerSetup` the safe trainer gathers before loading any weight, with the toy data as training set."""
    model, args, peft_config = model_and_peft(kind, model_args, args)
    return build_setup(kind, args, model, peft_config=peft_config, train_dataset=toy.dataset_for(kind))


def run_rules(setup: TrainerSetup):
    return run_setup_rules(setup, SafetyArguments.from_config(setup.args))


@pytest.mark.parametrize("name", sorted(TRAINER_CONFIGS))
def test_trainer_config_parses_and_passes_the_rules(name, toy_models, tmp_path):
    kind, toy_key = TRAINER_CONFIGS[name]
    path = CONFIGS / "trainers" / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    argv = ["--config", str(path), "--model_name_or_path", toy_models[toy_key], "--output_dir", str(tmp_path)]
    script_args, args, model_args = parse_args(kind, argv)

    # The YAML reached the right dataclasses; the overrides won.
    assert model_args.model_name_or_path == toy_models[toy_key]
    assert args.output_dir == str(tmp_path)
    assert script_args.dataset_name == raw["dataset_name"]
    assert args.bf16 is True and args.fp16 is False
    assert args.safety_mode == "fix" and args.nan_guard is True
    assert args.learning_rate == raw["learning_rate"]
    assert model_args.dtype == raw["dtype"]
    assert model_args.use_peft is raw.get("use_peft", False)
    if kind in ("grpo", "rloo"):
        assert script_args.reward_funcs == raw["reward_funcs"]
        assert args.num_generations == raw["num_generations"]

    setup, report = run_rules(pre_construction_setup(kind, script_args, args, model_args))  # raises if blocked
    assert [f for f in report.findings if f.action in ("blocked", "fixed")] == [], report.render()
    assert setup.args.model_init_kwargs["dtype"] == raw["dtype"]
    if name == "reward_lora":
        assert setup.peft_config.task_type == "SEQ_CLS"
    if name == "dpo_gemma2":
        assert setup.model_types & {"gemma2"}
        assert setup.args.model_init_kwargs["attn_implementation"] == "eager"


def test_trainer_config_typo_is_rejected(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("learning_rat: 1.0e-5\n")
    with pytest.raises(ValueError, match="learning_rat"):
        parse_args("dpo", ["--config", str(path), "--output_dir", str(tmp_path)])


BAD_DEEPSPEED = {
    "fp16": {"enabled": True},
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 2},
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def test_bad_deepspeed_config_rules(toy_models, tmp_path):
    """The rules alone: fp16 in the DeepSpeed section becomes bf16 and clipping 0.0 becomes 1.0, at the exact paths."""
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps(BAD_DEEPSPEED))
    script_args, args, model_args = parse_args(
        "dpo", ["--model_name_or_path", toy_models["qwen2"], "--output_dir", str(tmp_path), "--use_cpu", "true"]
    )
    setup = pre_construction_setup("dpo", script_args, args, model_args)
    setup = dataclasses.replace(setup, deepspeed_config=load_deepspeed_config(str(ds_path)))
    fixed, report = run_rules(setup)

    changes = {c.path: (c.old, c.new) for c in report.changes}
    assert changes["args.deepspeed.fp16.enabled"] == (True, False)
    assert changes["args.deepspeed.bf16.enabled"][1] is True
    assert changes["args.deepspeed.gradient_clipping"] == (0.0, 1.0)
    assert fixed.deepspeed_config["fp16"]["enabled"] is False
    assert fixed.deepspeed_config["bf16"]["enabled"] is True
    assert fixed.deepspeed_config["gradient_clipping"] == 1.0
    assert BAD_DEEPSPEED["fp16"]["enabled"] is True  # the user's dict is never mutated


TRAINER_WITH_BAD_DEEPSPEED = """
import json, sys
from safe_trainers import DPOConfig, DPOTrainer
from safe_trainers.testing import toy
model, ds, out = sys.argv[1:4]
args = DPOConfig(output_dir=out, deepspeed=ds, use_cpu=True, max_steps=1, report_to="none")
trainer = DPOTrainer(model=model, args=args, train_dataset=toy.dataset_for("dpo"))
json.dump({"deepspeed": trainer.args.deepspeed, "hf": trainer.args.hf_deepspeed_config.config,
           "bf16": trainer.args.bf16, "fp16": trainer.args.fp16, "max_grad_norm": trainer.args.max_grad_norm,
           "deepspeed_enabled": trainer.is_deepspeed_enabled}, open(out + "/constructed.json", "w"))
"""


def test_bad_deepspeed_config_fixed_by_dpo_trainer(toy_models, tmp_path):
    """`safe_trainers.DPOTrainer` given a DeepSpeed file with fp16 on and clipping 0.0: fixed and reported (no
    training). In a subprocess: DeepSpeed sets up a process group and global state that must not leak into the
    other tests."""
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps(BAD_DEEPSPEED))
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", TRAINER_WITH_BAD_DEEPSPEED, toy_models["qwen2"], str(ds_path), str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    report = json.loads((out / "safety_report.json").read_text())
    findings = {f["rule_id"]: f for f in report["findings"]}
    assert findings["precision.bf16_over_fp16"]["action"] == "fixed"
    assert findings["optim.grad_clip"]["action"] == "fixed"
    changes = {c["path"]: (c["old"], c["new"]) for f in report["findings"] for c in f["changes"]}
    assert changes["args.deepspeed.fp16.enabled"] == (True, False)
    assert changes["args.deepspeed.gradient_clipping"] == (0.0, 1.0)

    built = json.loads((out / "constructed.json").read_text())
    assert built["deepspeed_enabled"] is True
    assert built["deepspeed"]["fp16"]["enabled"] is False and built["deepspeed"]["bf16"]["enabled"] is True
    assert built["deepspeed"]["gradient_clipping"] == 1.0
    assert built["hf"]["fp16"]["enabled"] is False and built["hf"]["bf16"]["enabled"] is True
    assert built["hf"]["gradient_clipping"] == 1.0
    assert built["bf16"] is True and built["fp16"] is False and built["max_grad_norm"] == 1.0
    assert json.loads(ds_path.read_text()) == BAD_DEEPSPEED  # the user's file is never rewritten


