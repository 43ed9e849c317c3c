"""`safe-trainers check` judges the run it is told about (issue 12): the target's hardware, the launch's process count,
and only the settings the user wrote. Recipes in the style of published ones (alignment-handbook SFT, open-r1 GRPO)."""

from __future__ import annotations

import pytest

from safe_trainers.cli.main import main
from safe_trainers.cli.target import hold_target_fields, target_problems, target_values
from safe_trainers.rules.hardware import Hardware
from safe_trainers.testing.build import build_trainer


# A 7B-style SFT recipe as published for 8 x A100/H100: TF32 matmuls, NCCL, bf16, gradient checkpointing.
SFT_RECIPE = """\
bf16: true
tf32: true
ddp_backend: nccl
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
learning_rate: 2.0e-05
lr_scheduler_type: cosine
max_length: 2048
num_train_epochs: 1
per_device_train_batch_size: 16
gradient_accumulation_steps: 2
warmup_steps: 0.1
logging_steps: 5
save_strategy: "no"
report_to: none
"""

# A GRPO code-reasoning recipe as published for 8 GPUs (1 for vLLM, 7 training processes): 16 x 7 = 112 completions
# per step, in groups of 14. On one process, 16 is not a multiple of 14.
GRPO_RECIPE = """\
bf16: true
per_device_train_batch_size: 16
gradient_accumulation_steps: 4
num_generations: 14
max_completion_length: 256
temperature: 0.7
learning_rate: 1.0e-06
logging_nan_inf_filter: false
report_to: none
"""
ACCELERATE_7 = "distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_machines: 1\nnum_processes: 7\n"


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def check(kind: str, config: str, model: str, *extra: str) -> int:
    return main(["check", "--trainer", kind, "--config", config, "--model", model, *extra])


def test_hardware_dependent_fields_are_judged_for_the_target_not_this_machine(toy_models, tmp_path, capsys):
    config = write(tmp_path, "sft.yaml", SFT_RECIPE + f"output_dir: {tmp_path / 'out'}\n")
    # This machine has no GPU (transformers refuses `tf32` and `nccl` here); an H100 takes both.
    assert check("sft", config, toy_models["qwen2"], "--target-hardware", "H100") == 0
    assert "NVIDIA H100" in capsys.readouterr().out
    # On a V100 transformers would refuse `tf32=True` at start-up: the config is invalid for that target.
    assert check("sft", config, toy_models["qwen2"], "--target-hardware", "V100") == 2
    err = capsys.readouterr().err
    assert "`tf32=True`" in err and "V100" in err and "nccl" not in err
    assert check("sft", config, toy_models["qwen2"], "--target-hardware", "cpu") == 2
    assert "`ddp_backend='nccl'` needs CUDA GPUs" in capsys.readouterr().err


def test_target_fields_given_as_overrides_are_held_too(toy_models, tmp_path, capsys):
    config = write(tmp_path, "sft.yaml", f"output_dir: {tmp_path / 'out'}\nlogging_nan_inf_filter: false\n")
    argv = ["--target-hardware", "A100", "--tf32", "true", "--ddp_backend=nccl"]
    assert check("sft", config, toy_models["qwen2"], *argv) == 0
    assert check("sft", config, toy_models["qwen2"], "--target-hardware", "T4", "--tf32", "true") == 2


def test_hold_target_fields_and_problems_are_pure():
    config, overrides, held = hold_target_fields({"tf32": True, "bf16": True}, ["--tf32=false", "--fp16", "false"])
    assert config == {"bf16": True} and overrides == ["--fp16", "false"] and held == {"tf32": "false"}
    assert target_values(held) == {"tf32": False}
    assert target_problems({"tf32": True}, Hardware.target("H20")) == []
    assert target_problems({"tf32": True, "ddp_backend": "gloo"}, Hardware.target("cpu"))[0].startswith("`tf32=True`")
    with pytest.raises(ValueError, match="`tf32` takes true or false, got 'maybe'"):
        target_values({"tf32": "maybe"})


def test_grpo_groups_are_judged_for_the_launchs_process_count(toy_models, tmp_path, capsys):
    config = write(tmp_path, "grpo.yaml", GRPO_RECIPE + f"output_dir: {tmp_path / 'out'}\n")
    model = toy_models["qwen2"]
    # One process: 16 x 4 = 64 completions per generation, not a multiple of 14: refused, as TRL would on one GPU.
    assert check("grpo", config, model, "--target-hardware", "H100") == 2
    assert "num_generations=14" in capsys.readouterr().err
    accelerate = write(tmp_path, "accelerate.yaml", ACCELERATE_7)
    assert check("grpo", config, model, "--target-hardware", "H100", "--accelerate-config", accelerate) == 0
    out = capsys.readouterr().out
    assert "7 processes (`num_processes` of `--accelerate-config`)" in out
    assert check("grpo", config, model, "--target-hardware", "H100", "--num-processes", "7") == 0
    # The advice is computed for the stated count: 6 processes give 16 x 6 x 4 = 384, between 378 and 392.
    assert check("grpo", config, model, "--target-hardware", "H100", "--num-processes", "6") == 2
    assert "e.g. 378 or 392" in capsys.readouterr().err


def test_a_library_default_is_reported_apart_and_does_not_fail_check(toy_models, tmp_path, capsys):
    # TRL's `logging_nan_inf_filter=True` is changed for every config that leaves it alone: that is not a finding
    # about this recipe, so a clean recipe exits 0.
    clean = write(tmp_path, "clean.yaml", f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\n")
    assert check("dpo", clean, toy_models["qwen2"]) == 0
    out = capsys.readouterr().out
    assert "1 library default changed" in out and "Library defaults you did not set" in out
    assert "args.logging_nan_inf_filter: True -> False" in out
    # Written by the user, the same value is the user's setting: a finding, exit 1.
    explicit = write(tmp_path, "explicit.yaml", f"output_dir: {tmp_path / 'out'}\nlogging_nan_inf_filter: true\n")
    assert check("dpo", explicit, toy_models["qwen2"]) == 1
    assert "1 fixed" in capsys.readouterr().out


def test_strict_mode_accepts_a_default_config_and_still_changes_the_default(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, safety_mode="strict")
    (finding,) = trainer.safety_report.findings
    assert (finding.rule_id, finding.action, finding.library_default) == ("logging.show_nonfinite", "fixed", True)
    assert trainer.args.logging_nan_inf_filter is False
    assert trainer.safety_report.to_dict()["findings"][0]["library_default"] is True
