"""TRL 1.16 recipes run as written (issue 12, item 7): a `datasets:` mixture (`DatasetMixtureConfig`) and TRL's reward
function names (`trl.rewards`), through `safe-trainers check` and the launch scripts alike. Recipes in the style of
TRL's docs, on local files (no Hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trl.rewards

from safe_trainers.scripts import rewards
from safe_trainers.testing import toy
from safe_trainers.cli.main import main as cli
from safe_trainers.scripts.pipeline import main


QUICK = [
    "--max_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "1e-6", "--logging_steps", "1",
    "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--gradient_checkpointing", "false",
]  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_a_dataset_mixture_is_checked_and_trained(toy_models, tmp_path):
    rows = toy.dataset_for("dpo", 12).to_list()
    first, second = write_jsonl(tmp_path / "a.jsonl", rows[:8]), write_jsonl(tmp_path / "b.jsonl", rows[8:])
    recipe = write_recipe(
        tmp_path,
        f"model_name_or_path: {toy_models['qwen2']}\n"
        "datasets:\n"
        f"  - path: json\n    data_files: {first}\n    split: train\n"
        f"  - path: json\n    data_files: {second}\n    split: train\n    columns: [prompt, chosen, rejected]\n"
        f"output_dir: {tmp_path / 'out'}\nlogging_nan_inf_filter: false\nuse_cpu: true\n",
    )
    assert cli(["check", "--trainer", "dpo", "--config", recipe, *QUICK]) == 0  # was 2: "Unknown arguments"
    trainer = main("dpo", ["--config", recipe, *QUICK])
    assert len(trainer.train_dataset) == 12 and trainer.state.global_step == 2


def test_trl_reward_names_resolve_to_trls_functions():
    assert rewards.load_reward_func("think_format_reward") is trl.rewards.think_format_reward
    assert rewards.load_reward_func("accuracy_reward") is trl.rewards.accuracy_reward
    overlong = rewards.load_reward_func("get_soft_overlong_punishment")  # built as TRL's script builds it
    assert overlong(completion_ids=[[0] * 1024, [0] * 1280]) == [0.0, -1.0]
    problem = rewards.reward_name_problem("accuracy")
    assert problem is not None and "think_format_reward" in problem


def test_a_grpo_recipe_with_trl_rewards_is_checked_and_trained(toy_models, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", toy.dataset_for("grpo", 8).to_list())
    recipe = write_recipe(
        tmp_path,
        f"model_name_or_path: {toy_models['qwen2']}\ndataset_name: {prompts}\n"
        "reward_funcs: [get_soft_overlong_punishment, count_words]\n"
        f"num_generations: 2\nmax_completion_length: 8\noutput_dir: {tmp_path / 'out'}\n"
        "logging_nan_inf_filter: false\nuse_cpu: true\n",
    )
    assert cli(["check", "--trainer", "grpo", "--config", recipe, *QUICK]) == 0
    trainer = main("grpo", ["--config", recipe, *QUICK])  # refused before: "Unknown reward function"
    assert [f.__name__ for f in trainer.reward_funcs] == ["soft_overlong_punishment_reward", "count_words"]
    assert trainer.state.global_step == 2


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_check_warns_of_the_reward_names_the_scripts_refuse(toy_models, tmp_path, capsys, kind):
    recipe = write_recipe(
        tmp_path,
        f"model_name_or_path: {toy_models['qwen2']}\ndataset_name: x.jsonl\nreward_funcs: [accuracy]\n"
        f"num_generations: 2\noutput_dir: {tmp_path / 'out'}\n",
    )
    # was 2 ("not a valid config"): a script of the user's own (open-r1's) may build the name, so only a warning.
    assert cli(["check", "--trainer", kind, "--config", recipe]) == 0
    err = capsys.readouterr().err
    assert "warning: `reward_funcs` names 'accuracy'" in err and f"`launch/train_{kind}.py` will refuse" in err
    with pytest.raises(ValueError, match="Unknown reward function 'accuracy'"):  # the launch scripts still refuse it
        main(kind, ["--config", recipe, *QUICK])
