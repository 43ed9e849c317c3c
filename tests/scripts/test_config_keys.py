"""Settings no dataclass reads (`safe_trainers.scripts.config_keys`): a recipe written for an older TRL or transformers
(`torch_dtype`, `max_prompt_length`, `overwrite_output_dir`), a key of open-r1's own script, a misspelling, in the
`--config` file or on the command line. Each gets one line with its fix, in the launch scripts (exit 2, before anything
is loaded) and in `safe-trainers check`; a setting an installed release still reads is never reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
import trl

from safe_trainers.cli.main import main as cli
from safe_trainers.configs import config_class
from safe_trainers.scripts.arguments import ScriptArguments
from safe_trainers.scripts.config_keys import RETIRED, field_names, leftover_settings, unknown_key_problems
from safe_trainers.scripts.entry import run
from safe_trainers.scripts.inputs import InputError
from safe_trainers.scripts.pipeline import main
from safe_trainers.testing import toy


KINDS = ["sft", "reward", "dpo", "kto", "grpo", "rloo"]
VERSIONS = "TRL x, transformers y"


def known(kind: str) -> frozenset[str]:
    return field_names([ScriptArguments, config_class(kind), trl.ModelConfig])


def test_a_renamed_key_names_its_new_name_and_keeps_the_value():
    [problem] = unknown_key_problems({"torch_dtype": "bfloat16"}, known("grpo"), VERSIONS)
    assert problem.setting == "torch_dtype" and problem.value == "bfloat16"
    assert problem.message == (
        "`torch_dtype='bfloat16'` in the `--config` file was renamed `dtype` by transformers: TRL x, transformers y "
        "have no `torch_dtype`. Rename it `dtype` (same values)."
    )


def test_a_removed_key_says_what_bounds_the_length_now():
    [problem] = unknown_key_problems({"max_prompt_length": 512}, known("dpo"), VERSIONS)
    assert "was removed by TRL" in problem.message and "`max_length`" in problem.fix


def test_open_r1_script_keys_and_misspellings_are_told_apart():
    problems = unknown_key_problems({"system_prompt": "Think.", "lerning_rate": 1e-5}, known("grpo"), VERSIONS)
    assert [p.setting for p in problems] == ["system_prompt", "lerning_rate"]  # file order
    assert "open-r1's own script" in problems[0].problem
    assert problems[1].fix == "Did you mean `learning_rate`? Fix the name, or remove it."
    [far] = unknown_key_problems({"zzz_unheard_of": 1}, known("grpo"), VERSIONS)
    assert far.fix == "Fix the name, or remove it."  # no far-fetched guess


def test_command_line_leftovers_are_read_as_settings_and_stray_values():
    settings, stray = leftover_settings(["--lerning-rate", "1e-5", "--max_seq_length=8", "--flag", "--x", "a", "b"])
    assert settings == {"lerning_rate": "1e-5", "max_seq_length": "8", "flag": None, "x": "a"} and stray == ["b"]
    problems = unknown_key_problems(settings, known("sft"), VERSIONS, "on the command line", "train --help")
    assert [p.setting for p in problems] == ["lerning_rate", "max_seq_length", "flag", "x"]
    assert problems[0].message == (
        "`lerning_rate='1e-5'` on the command line is not a setting of this launch (TRL x, transformers y). "
        "Did you mean `learning_rate`? Fix the name, or remove it; `train --help` lists every setting."
    )
    assert problems[1].fix == "Rename it `max_length`."


@pytest.mark.parametrize("kind", KINDS)
def test_no_setting_of_the_installed_releases_is_reported(kind):
    # A retired name that a config still reads (GRPO's `max_completion_length`) is a setting, not a problem.
    settings = {name: None for name in known(kind)} | {"env": {"A": "1"}}
    assert unknown_key_problems(settings, known(kind), VERSIONS) == []


def test_every_replacement_the_table_names_is_a_setting_today():
    # Fails when an upstream release renames one of them again: the table would send users to a dead name.
    every = frozenset().union(*(known(kind) for kind in KINDS))
    assert {r.now for r in RETIRED.values() if r.now} <= every
    # and none of the retired names came back (GRPO and RLOO keep `max_completion_length`; DPO and KTO dropped it)
    assert set(RETIRED) & every <= {"max_completion_length"}


# An open-r1 GRPO recipe as written for TRL 0.18 and transformers 4 (their layout, our values).
OLD_RECIPE = """\
model_name_or_path: {model}
model_revision: main
torch_dtype: float32
dataset_name: {data}
dataset_prompt_column: prompt
system_prompt: "You are a helpful assistant."
gradient_accumulation_steps: 1
learning_rate: 1.0e-06
max_prompt_length: 512
max_completion_length: 8
num_generations: 2
output_dir: {out}
overwrite_output_dir: true
per_device_train_batch_size: 2
report_to: none
reward_funcs:
- count_words
seed: 42
use_cpu: true
"""
STALE = ["torch_dtype", "dataset_prompt_column", "system_prompt", "max_prompt_length", "overwrite_output_dir"]


@pytest.fixture
def old_recipe(toy_models, tmp_path) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in toy.dataset_for("grpo", 8).to_list()))
    path = tmp_path / "config.yaml"
    path.write_text(OLD_RECIPE.format(model=toy_models["qwen2"], data=prompts, out=tmp_path / "out"))
    return path


def test_the_launch_script_names_every_stale_key_before_loading_anything(old_recipe, tmp_path, capsys):
    with pytest.raises(InputError) as raised:  # a ValueError, as TRL's parser raises
        main("grpo", ["--config", str(old_recipe), "--max_steps", "1"])
    assert [p.setting for p in raised.value.problems] == STALE
    assert f"TRL {trl.__version__}, transformers {transformers.__version__}" in str(raised.value)
    assert not (tmp_path / "out").exists()
    # Through the scripts' entry point: one message, exit 2, no traceback.
    with pytest.raises(SystemExit) as exited:
        run("grpo", ["--config", str(old_recipe)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "5 settings need a fix" in err and "Rename it `dtype`" in err


def test_check_names_them_too_and_passes_the_recipe_once_fixed(old_recipe, capsys):
    argv = ["check", "--trainer", "grpo", "--config", str(old_recipe)]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert all(f"`{key}=" in err for key in STALE) and "add them to the dataclass" not in err
    lines = old_recipe.read_text().splitlines()
    kept = [line for line in lines if line.split(":")[0] not in STALE[1:]]
    old_recipe.write_text("\n".join(kept).replace("torch_dtype:", "dtype:") + "\n")
    assert cli(argv) == 0
