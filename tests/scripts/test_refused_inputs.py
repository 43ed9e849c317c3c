"""The inputs the launch scripts refuse (model and reward directories, data files and splits, resume targets, flags,
config and DeepSpeed files), each with one message and exit status 2, and their working neighbours accepted (issue 23,
item 1, found by trying to break that contract; the exit status as a program: `test_script_exit_status.py`). Run in
process through the scripts' entry point (`launch/train_<kind>.py` is `entry.run(kind)`), and in `safe-trainers check`
where it judges the same setting."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from safe_trainers.cli.main import main as cli
from safe_trainers.scripts import entry, places
from safe_trainers.scripts.inputs import Facts, judge, resume_target
from safe_trainers.scripts.pipeline import main


ROOT = Path(__file__).resolve().parents[2]


def refused(capsys, kind: str, argv: list[str]) -> str:
    """Run `launch/train_<kind>.py <argv>` in process: it must exit 2 with one `train_<kind>: error:` message, which
    is returned."""
    with pytest.raises(SystemExit) as exit_:
        entry.run(kind, argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.count(f"train_{kind}: error:") == 1 and "Traceback" not in err, err
    return err[err.index(f"train_{kind}: error:") :]


BELOW_ONE = [("per_device_train_batch_size", "0"), ("per_device_train_batch_size", "-1"),
             ("gradient_accumulation_steps", "0")]  # fmt: skip


@pytest.mark.parametrize("flag, value", BELOW_ONE)
def test_a_batch_size_below_one_before_any_model(flag, value, tmp_path, capsys):
    # was: torch's "batch_size should be a positive integer value" (or a ZeroDivisionError in transformers'
    # training loop) in a traceback, after the model loaded; `check` exited 0
    message = refused(capsys, "dpo", [f"--{flag}", value, "--output_dir", str(tmp_path / "out")])
    assert f"`{flag}={int(value)}` is not a positive number" in message and f"`--{flag} " in message
    assert not (tmp_path / "out" / "toy-model").exists()  # refused before even the toy model was built
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\n")
    assert cli(["check", "--trainer", "dpo", "--config", str(config), f"--{flag}", value]) == 2
    assert f"`{flag}={int(value)}` is not a positive number" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, fragment",
    [("no_such_module_xyz:reward", "Could not import module `no_such_module_xyz`"),
     ("safe_trainers.scripts.rewards:nothing_here", "has no callable `nothing_here`")],
)  # fmt: skip
def test_a_reward_path_that_does_not_resolve(name, fragment, tmp_path, capsys):
    # was: the same text inside a ValueError traceback (the form is fine, so the start-up name check let it through)
    message = refused(capsys, "grpo", ["--reward_funcs", name, "--output_dir", str(tmp_path / "out")])
    assert fragment in message and f"{name!r} in `reward_funcs`" in message
    assert not (tmp_path / "out" / "toy-model").exists()  # before any data or weight


def sharded_model(toy_models, path: Path) -> Path:
    """The toy qwen2 model saved in two safetensors shards with their index, plus its tokenizer."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(toy_models["qwen2"]).save_pretrained(path, max_shard_size="100KB")
    for name in os.listdir(toy_models["qwen2"]):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(toy_models["qwen2"], name), path / name)
    assert len(list(path.glob("model-0000*-of-00002.safetensors"))) == 2
    return path


def test_a_model_directory_without_its_weights_before_any_model(toy_models, tmp_path, capsys):
    # was: transformers' OSError "no file named model.safetensors, or pytorch_model.bin" in a traceback
    model = tmp_path / "no-weights"
    shutil.copytree(toy_models["qwen2"], model, ignore=shutil.ignore_patterns("*.safetensors"))
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    argv = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")]
    message = refused(capsys, "dpo", argv)
    assert f"`model_name_or_path={str(model)!r}` is a directory without `*.safetensors` or `*.bin` weights" in message


def test_a_sharded_model_with_a_shard_missing(toy_models, tmp_path, capsys):
    # was: a traceback from the loader, after the other shards were read
    model = sharded_model(toy_models, tmp_path / "sharded")
    (model / "model-00002-of-00002.safetensors").unlink()
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    argv = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")]
    message = refused(capsys, "dpo", argv)
    assert "without the weight shards its index names: ['model-00002-of-00002.safetensors']" in message


def test_model_directories_that_load_are_not_refused(toy_models, tmp_path):
    """No false alarm: a single-file model, a sharded one, and a LoRA adapter directory pass the model check."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"])
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    for model in (toy_models["qwen2"], sharded_model(toy_models, tmp_path / "sharded"), adapter):
        place = places.observe(str(model), "model", online=False)
        assert judge("settings", {"model_name_or_path": str(model)}, Facts(model=place)) == [], model


def test_a_misspelt_flag_names_the_setting_it_meant(tmp_path, capsys):
    # was: "Some specified arguments are not used by the HfArgumentParser: ['--learnig_rate', '1e-5']"
    message = refused(capsys, "dpo", ["--learnig_rate", "1e-5", "--output_dir", str(tmp_path / "out")])
    assert "`learnig_rate='1e-5'` on the command line is not a setting of this launch (TRL" in message
    assert "Did you mean `learning_rate`?" in message and "`python launch/train_dpo.py --help`" in message


def test_a_recipe_written_for_another_trl_version(tmp_path, capsys):
    # a recipe in the style of older TRL releases: keys this TRL renamed or dropped. Was: "Unknown arguments from
    # config file: [...]. Please remove them, add them to the dataclass, or set `fail_with_unknown_args=False`."
    recipe = tmp_path / "sft_old.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\nmax_seq_length: 1024\nevaluation_strategy: 'no'\n"
                      "torch_dtype: bfloat16\nlearning_rate: 2.0e-5\n")  # fmt: skip
    message = refused(capsys, "sft", ["--config", str(recipe)])
    assert message.startswith("train_sft: error: 3 settings need a fix:") and "dataclass" not in message
    for old, new in [("max_seq_length", "max_length"), ("evaluation_strategy", "eval_strategy"),
                     ("torch_dtype", "dtype")]:  # fmt: skip
        assert f"`{old}=" in message and f"in the `--config` file was renamed `{new}`" in message
        assert f"Rename it `{new}`" in message
    config = tmp_path / "old_check.yaml"
    config.write_text(recipe.read_text() + "use_cpu: true\n")
    assert cli(["check", "--trainer", "sft", "--config", str(config)]) == 2
    assert "Rename it `max_length`." in capsys.readouterr().err


def test_a_malformed_jsonl_names_what_the_reader_found(toy_models, tmp_path, capsys):
    # was: "could not be read: DatasetGenerationError: An error occurred while generating the dataset" (the reader's
    # own complaint only in a log line above)
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"\n')
    argv = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", str(data), "--output_dir", str(tmp_path)]
    message = refused(capsys, "dpo", argv)
    assert "could not be read: ArrowInvalid: JSON parse error" in message and "DatasetGenerationError" not in message


def test_a_home_path_in_a_config_file_is_not_said_to_be_missing(toy_models, tmp_path, monkeypatch, capsys):
    # `~/...` in a YAML file is not expanded (by the shell, TRL's parser or the loaders). Was: "does not exist (nothing
    # at /home/me/models/qwen2)", while the model is right there.
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(toy_models["qwen2"], tmp_path / "qwen2")
    (tmp_path / "prefs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: ~/qwen2\ndataset_name: ~/prefs.jsonl\noutput_dir: {tmp_path / 'out'}\n")
    message = refused(capsys, "dpo", ["--config", str(config)])
    assert "`model_name_or_path='~/qwen2'` starts with `~`, which is not expanded" in message
    assert f"Write the full path, `{tmp_path / 'qwen2'}`." in message and "does not exist" not in message
    assert "`dataset_name='~/prefs.jsonl'` starts with `~`" in message


def test_resume_from_a_checkpoint_that_does_not_exist_before_any_model(tmp_path, capsys):
    # was: transformers' "Can't find a valid checkpoint at ..." in a traceback, after the model loaded
    out = str(tmp_path / "out")
    message = refused(capsys, "dpo", ["--resume_from_checkpoint", f"{out}/checkpoint-500", "--output_dir", out])
    assert "`resume_from_checkpoint=" in message and "is not a checkpoint directory (nothing at" in message
    assert "`--resume_from_checkpoint true`" in message
    assert not (tmp_path / "out" / "toy-model").exists()


@pytest.mark.parametrize("value, target", [("true", True), ("True", True), ("false", None), ("ckpt/checkpoint-5",
                                            "ckpt/checkpoint-5"), (None, None), (True, True)])  # fmt: skip
def test_resume_true_on_the_command_line_means_the_newest_checkpoint(value, target):
    # was: `--resume_from_checkpoint true` reached `train()` as the string "true" (a traceback: "Can't find a valid
    # checkpoint at true")
    assert resume_target(value) == target
    if not isinstance(target, str):  # not a path: nothing to look for
        assert judge("settings", {"resume_from_checkpoint": value}, Facts(checkpoint=places.local(str(value)))) == []


@pytest.mark.slow  # a process of its own, or a real run
def test_resume_true_resumes_the_newest_checkpoint(tmp_path):
    out = tmp_path / "out"
    quick = ["--output_dir", str(out), "--save_steps", "1", "--report_to", "none", "--disable_tqdm", "true"]
    main("dpo", [*quick, "--max_steps", "2"])
    shutil.rmtree(out / "checkpoint-1")  # a run started over would write it again
    trainer = main("dpo", [*quick, "--max_steps", "3", "--resume_from_checkpoint", "true"])
    assert trainer.state.global_step == 3 and (out / "checkpoint-3").is_dir() and not (out / "checkpoint-1").exists()


def test_a_split_the_saved_dataset_does_not_have(toy_models, tmp_path, capsys):
    # was: the same text inside a ValueError traceback
    from datasets import DatasetDict

    from safe_trainers.testing.toy import dataset_for

    DatasetDict(train=dataset_for("dpo")).save_to_disk(str(tmp_path / "prefs"))
    argv = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", str(tmp_path / "prefs"),
            "--dataset_train_split", "training", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    message = refused(capsys, "dpo", argv)
    assert "has no split 'training'; its splits are ['train']" in message and "`dataset_train_split`" in message


EVAL = ["--eval_strategy", "steps", "--eval_steps", "1"]


def test_evaluation_on_a_single_file_is_not_the_training_rows(toy_models, prefs_file, tmp_path, capsys):
    # was: exit 0, with the "eval" metrics computed on the training rows (the file served every split name)
    argv = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", prefs_file, *EVAL, "--output_dir",
            str(tmp_path / "out")]  # fmt: skip
    message = refused(capsys, "dpo", argv)
    assert "holds one split, read as the training split 'train', so it has no split 'test'" in message
    assert "`--eval_strategy no`" in message and "`--dataset_test_split train`" in message


def test_a_folder_of_data_files_without_the_test_split(toy_models, prefs_file, tmp_path, capsys):
    # was: datasets' `ValueError: Unknown split "test"` in a traceback
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(prefs_file, folder / "train.jsonl")
    argv = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", str(folder), *EVAL, "--output_dir",
            str(tmp_path / "out")]  # fmt: skip
    message = refused(capsys, "dpo", argv)
    assert f"The folder {str(folder)!r} has no split 'test'; its splits are ['train']" in message


def test_a_folder_with_train_and_test_files_evaluates_on_the_test_file(toy_models, prefs_file, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(prefs_file, folder / "train.jsonl")
    shutil.copy(prefs_file, folder / "test.jsonl")
    argv = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", str(folder), *EVAL, "--max_steps", "1",
            "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--save_strategy", "no"]  # fmt: skip
    trainer = main("dpo", argv)
    assert any("eval_loss" in entry for entry in trainer.state.log_history)


@pytest.fixture
def prefs_file(tmp_path) -> str:
    from safe_trainers.testing.toy import dataset_for

    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in dataset_for("dpo").to_list()))
    return str(path)


def test_lora_target_modules_the_model_does_not_have(toy_models, prefs_file, tmp_path, capsys):
    # was: peft's NoMatchingPeftModuleError in a traceback (judged when the model is loaded: the earliest it can be)
    argv = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", prefs_file, "--use_peft",
            "--lora_target_modules", "nope_proj", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    message = refused(capsys, "dpo", argv)
    assert "Target modules nope_proj not found in the base model" in message
    assert "`--lora_target_modules`" in message and "`all-linear`" in message


def test_a_reward_model_directory_without_weights_before_any_model(toy_models, tmp_path, capsys):
    # was: transformers' OSError traceback when GRPO loaded the reward model, after the policy
    reward_model = tmp_path / "rm"
    shutil.copytree(toy_models["qwen2-rm"], reward_model, ignore=shutil.ignore_patterns("*.safetensors"))
    message = refused(capsys, "grpo", ["--reward_funcs", str(reward_model), "--output_dir", str(tmp_path / "out")])
    assert f"names the directory {str(reward_model)!r} as a reward model" in message
    assert "without `*.safetensors` or `*.bin` weights" in message
    assert not (tmp_path / "out" / "toy-model").exists()
    # `check` warns about the same directory (it passed it with exit 0 and no warning, then the launch refused it)
    config = tmp_path / "config.yaml"
    config.write_text(f"model_name_or_path: {toy_models['qwen2']}\noutput_dir: {tmp_path / 'out'}\nuse_cpu: true\n"
                      f"reward_funcs:\n- {reward_model}\n")  # fmt: skip
    assert cli(["check", "--trainer", "grpo", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert f"warning: `reward_funcs` names {str(reward_model)!r}, which the shipped launch scripts cannot build" in err
    assert "without `*.safetensors` or `*.bin` weights" in err


def test_a_whole_reward_model_directory_is_accepted(toy_models):
    from safe_trainers.scripts import preflight

    preflight.check_reward_names([toy_models["qwen2-rm"], "count_words"])  # no false alarm: raises nothing


@pytest.mark.parametrize(
    "config, fragment",
    [("configs/accelerate/multi_gpu.yaml", "is an accelerate config, not the trainer's settings"),
     ("configs/deepspeed/zero2.json", "is a DeepSpeed config, not the trainer's settings")],
)  # fmt: skip
def test_a_launchers_config_given_as_the_trainers(config, fragment, tmp_path, capsys):
    # was: "Your setup doesn't support bf16/gpu" (the accelerate file's `use_cpu: false`), or "invalid int value:
    # 'auto'" (DeepSpeed's `"auto"`): neither said which file was wrong
    path = str(ROOT / config)
    message = refused(capsys, "dpo", ["--config", path, "--output_dir", str(tmp_path / "out")])
    assert f"`config={path!r}` {fragment}" in message
    assert ("--config_file" if "accelerate" in config else f"`--deepspeed {path}`") in message
    assert cli(["check", "--trainer", "dpo", "--config", path]) == 2 and fragment in capsys.readouterr().err


def test_shipped_trainer_configs_are_trainer_configs():
    for path in sorted((ROOT / "configs" / "trainers").glob("*.yaml")):  # no false alarm on the shipped ones
        assert places.read_config_file(str(path)).state == "mapping", path


@pytest.mark.parametrize(
    "content, fragment",
    [(None, "names no file"), ("{bad", "could not be read as JSON"),
     ("compute_environment: LOCAL_MACHINE\n", "is an accelerate config, not a DeepSpeed config")],
)  # fmt: skip
@pytest.mark.parametrize("where", ["command line", "config file"])
def test_a_deepspeed_file_that_cannot_be_read(content, fragment, where, tmp_path, capsys):
    # was: transformers' "Expected a string path to an existing deepspeed config ..." or json's bare "Expecting
    # property name enclosed in double quotes: line 1 column 2 (char 1)", naming neither the setting nor the file
    ds = tmp_path / "ds.json"
    if content is not None:
        ds.write_text(content)
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\n" + (f"deepspeed: {ds}\n" if where == "config file" else ""))
    argv = ["--config", str(config), *(["--deepspeed", str(ds)] if where == "command line" else [])]
    message = refused(capsys, "dpo", argv)
    assert f"`deepspeed={str(ds)!r}` {fragment}" in message and "`--deepspeed configs/deepspeed/zero2.json`" in message
    assert cli(["check", "--trainer", "dpo", *argv]) == 2 and fragment in capsys.readouterr().err


def test_the_shipped_deepspeed_files_are_read():
    from safe_trainers.scripts import preflight

    for path in sorted((ROOT / "configs" / "deepspeed").glob("*.json")):  # no false alarm
        preflight.check_argv(["--deepspeed", str(path)])


def test_an_empty_config_file_is_refused_by_check_as_by_the_launch(tmp_path, capsys):
    # was: `check` read an empty file as no settings and went on; the launch stopped at TRL's "must contain a YAML
    # mapping"
    config = tmp_path / "empty.yaml"
    config.write_text("")
    message = refused(capsys, "dpo", ["--config", str(config)])
    assert f"`config={str(config)!r}` does not hold a mapping of settings" in message
    assert cli(["check", "--trainer", "dpo", "--config", str(config)]) == 2
    assert f"`config={str(config)!r}` does not hold a mapping of settings" in capsys.readouterr().err
