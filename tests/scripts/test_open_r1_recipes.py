"""open-r1 style GRPO recipes (issue 23, item 3): a recipe naming open-r1's own reward functions (`accuracy`,
`tag_count`, `code`, ...), which open-r1's `grpo.py` builds and the shipped launch scripts cannot, gets a warning from
`safe-trainers check` (exit 0 when nothing else is wrong) and is refused by the launch scripts at start-up, before any
data or weight is loaded; a recipe whose rewards the scripts build is checked with exit 0 and trains.

The recipes are written in the layout of open-r1's `recipes/<model>/grpo/config_*.yaml` (model, data and GRPO sections,
`reward_funcs` with `reward_weights`), with today's TRL and transformers field names and local files (no Hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from safe_trainers.cli.main import main as cli
from safe_trainers.scripts.pipeline import main
from safe_trainers.testing import toy


QUICK = [
    "--max_steps", "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
    "--num_generations", "2", "--max_completion_length", "8", "--logging_steps", "1", "--report_to", "none",
    "--save_strategy", "no", "--disable_tqdm", "true", "--use_cpu", "true",
]  # fmt: skip

MATH = """\
# Model arguments
model_name_or_path: {model}
model_revision: main
dtype: bfloat16
attn_implementation: sdpa

# Data training arguments
dataset_name: {data}

# GRPO trainer config
bf16: true
gradient_accumulation_steps: 4
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
learning_rate: 1.0e-06
log_completions: true
logging_first_step: true
logging_steps: 1
logging_nan_inf_filter: false
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
max_completion_length: 1024
num_generations: 16
num_train_epochs: 1
output_dir: {out}
per_device_train_batch_size: 16
report_to: none
reward_funcs:
- accuracy
- format
- tag_count
reward_weights:
- 1.0
- 1.0
- 1.0
save_strategy: "epoch"
save_total_limit: 1
seed: 42
temperature: 0.7
warmup_steps: 0.1
"""

# The code recipe: 7 training processes (the 8th GPU serves vLLM), so that the generation batch of 16 x 7 x 4 = 448
# completions holds whole groups of 14.
CODE = """\
# Model arguments
model_name_or_path: {model}
model_revision: main
dtype: bfloat16
attn_implementation: sdpa

# Data training arguments
dataset_name: {data}

# GRPO trainer config
beta: 0.01
bf16: true
use_vllm: true
gradient_accumulation_steps: 4
gradient_checkpointing: true
learning_rate: 5.0e-06
logging_steps: 1
logging_nan_inf_filter: false
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
max_completion_length: 2048
max_steps: 500
num_generations: 14
output_dir: {out}
per_device_train_batch_size: 16
report_to: none
reward_funcs:
- code
- format
reward_weights:
- 1.0
- 0.1
save_strategy: "steps"
save_steps: 50
seed: 42
temperature: 1.0
warmup_steps: 0.03
"""

ZERO2 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_multinode_launcher: standard
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
use_cpu: false
"""

# The same layout with rewards the launch scripts build: the built-in `format` (open-r1's name for its think/answer
# format reward) and `count_words`.
BUILDABLE = """\
# Model arguments
model_name_or_path: {model}
dtype: float32

# Data training arguments
dataset_name: {data}

# GRPO trainer config
beta: 0.0
learning_rate: 1.0e-06
logging_steps: 1
logging_nan_inf_filter: false
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
num_generations: 2
output_dir: {out}
per_device_train_batch_size: 2
report_to: none
reward_funcs:
- format
- count_words
reward_weights:
- 0.5
- 1.0
seed: 42
temperature: 1.0
use_cpu: true
"""


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture
def recipe(toy_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in toy.dataset_for("grpo", 8).to_list()))

    def make(template: str, data: str = str(prompts)) -> str:
        text = template.format(model=toy_models["qwen2"], data=data, out=tmp_path / "out")
        return write(tmp_path / "config.yaml", text)

    return make


def test_a_math_recipe_with_open_r1_rewards_is_warned_not_refused(recipe, capsys):
    path = recipe(MATH)
    assert cli(["check", "--trainer", "grpo", "--config", path, "--target-hardware", "H100"]) == 0  # was 2
    err = capsys.readouterr().err
    for name in ("accuracy", "tag_count"):
        assert f"warning: `reward_funcs` names {name!r}, which the shipped launch scripts cannot build" in err
    assert "'format'" not in err  # a built-in name: the scripts build it
    assert "`--reward_funcs open_r1.rewards:accuracy_reward`" in err  # how to run it with the shipped scripts
    assert "`launch/train_grpo.py` will refuse this config at start-up" in err


def test_the_multi_process_code_recipe_is_warned_and_its_groups_checked(recipe, tmp_path, capsys):
    path = recipe(CODE)
    accelerate = write(tmp_path / "zero2.yaml", ZERO2)
    argv = ["check", "--trainer", "grpo", "--config", path, "--accelerate-config", accelerate, "--target-hardware"]
    argv.append("H100")
    assert cli([*argv, "--num-processes", "7"]) == 0  # was 2: "Unknown reward function 'code'"
    captured = capsys.readouterr()
    assert "warning: `reward_funcs` names 'code'" in captured.err and "open_r1.rewards.code_reward" in captured.err
    assert "7 processes" in captured.out  # the launch the rules were run for
    # The same recipe on all 8 processes of the accelerate config: 512 completions are not whole groups of 14.
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "num_generations" in err and "warning: `reward_funcs`" not in err


@pytest.mark.parametrize("template", [MATH, CODE], ids=["math", "code"])
def test_the_launch_scripts_refuse_open_r1_reward_names_at_start_up(recipe, template, tmp_path):
    # The data file does not exist: the reward names are refused first, before any data or weight is loaded.
    path = recipe(template, data=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"Unknown reward function '(accuracy|code)' in `reward_funcs`.*open-r1"):
        main("grpo", ["--config", path, *QUICK])
    assert not (tmp_path / "out").exists()


def test_a_recipe_that_check_passes_launches(recipe, capsys):
    path = recipe(BUILDABLE)
    assert cli(["check", "--trainer", "grpo", "--config", path, *QUICK]) == 0
    assert "warning" not in capsys.readouterr().err
    trainer = main("grpo", ["--config", path, *QUICK])
    assert [f.__name__ for f in trainer.reward_funcs] == ["format", "count_words"]
    assert trainer.args.reward_weights == [0.5, 1.0] and trainer.state.global_step == 2
