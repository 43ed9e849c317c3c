"""`safe_trainers.scripts.pipeline` in-process: parse a YAML config plus overrides, load local data, train a few steps,
save, and report; plus the dataset sources, the reward functions and the argument errors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file

from safe_trainers.scripts import rewards
from safe_trainers.testing import toy
from safe_trainers.scripts.pipeline import ScriptArguments, load_train_dataset, main, model_and_peft, parse_args


ROOT = Path(__file__).resolve().parents[2]

QUICK = [
    "--max_steps", "2",
    "--per_device_train_batch_size", "2",
    "--learning_rate", "1e-3",
    "--logging_steps", "1",
    "--report_to", "none",
    "--save_strategy", "no",
    "--disable_tqdm", "true",
    "--gradient_checkpointing", "false",
]  # fmt: skip


def write_jsonl(path: Path, dataset: Dataset) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in dataset.to_list()))
    return str(path)


def changed_tensors(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in before if name in after and not torch.equal(before[name].float(), after[name].float())]


def assert_trained_and_saved(trainer, output_dir: Path, kind: str, steps: int = 2) -> None:
    assert trainer.state.global_step == steps
    logged = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == list(range(1, steps + 1))
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)
    report = json.loads((output_dir / "safety_report.json").read_text())
    assert report["trainer"] == kind and report["mode"] == "fix"


def test_dpo_main_trains_and_saves(toy_models, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", toy.dataset_for("dpo"))
    out = tmp_path / "out"
    argv = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", data, "--output_dir", str(out)]
    trainer = main("dpo", argv + QUICK)

    assert_trained_and_saved(trainer, out, "dpo")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    before = load_file(str(Path(toy_models["qwen2"]) / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    assert set(after) == set(before)
    assert len(changed_tensors(before, after)) > len(before) // 2
    assert trainer.nan_guard is not None  # the NaN guard is on by default in the scripts


def test_reward_lora_config_with_causal_lm_task_is_fixed(toy_models, tmp_path):
    """The shipped LoRA reward config, overridden to the wrong `lora_task_type`: the rule fixes it to `SEQ_CLS` and
    reports it, and the score head is trained and saved with the adapter (PEFT would otherwise leave it random)."""
    data = write_jsonl(tmp_path / "prefs.jsonl", toy.dataset_for("reward"))
    out = tmp_path / "out"
    argv = ["--config", str(ROOT / "configs/trainers/reward_lora.yaml"),
            "--model_name_or_path", toy_models["qwen2-rm"], "--dataset_name", data, "--output_dir", str(out),
            "--lora_task_type", "CAUSAL_LM", "--max_length", "64"]  # fmt: skip
    trainer = main("reward", argv + QUICK)

    assert_trained_and_saved(trainer, out, "reward")
    [finding] = trainer.safety_report.by_rule("peft.reward_seq_cls_lora")
    assert finding.action == "fixed"
    assert [(c.path, c.old, c.new) for c in finding.changes] == [("peft_config.task_type", "CAUSAL_LM", "SEQ_CLS")]
    assert trainer.model.peft_config["default"].task_type == "SEQ_CLS"
    report = json.loads((out / "safety_report.json").read_text())
    assert "peft.reward_seq_cls_lora" in {f["rule_id"] for f in report["findings"]}

    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    adapter = load_file(str(out / "adapter_model.safetensors"))
    head = [name for name in adapter if ".score." in name]
    assert head, sorted(adapter)
    base_head = load_file(str(Path(toy_models["qwen2-rm"]) / "model.safetensors"))["score.weight"]
    assert not torch.equal(adapter[head[0]].float(), base_head.float())  # trained, not the random init
    assert any("lora_B" in name and adapter[name].abs().sum() > 0 for name in adapter)  # LoRA B starts at 0


def test_grpo_main_with_module_reward(toy_models, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            CALLS = []

            def char_count(completions, **kwargs):
                CALLS.append(len(completions))
                return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_jsonl(tmp_path / "prompts.jsonl", toy.dataset_for("grpo"))
    out = tmp_path / "out"
    argv = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", data, "--output_dir", str(out),
            "--reward_funcs", "my_rewards:char_count", "count_words",
            "--num_generations", "2", "--max_completion_length", "8"]  # fmt: skip
    trainer = main("grpo", argv + QUICK)

    import my_rewards

    assert_trained_and_saved(trainer, out, "grpo")
    assert my_rewards.CALLS, "the user's reward function was never called"
    assert [f.__name__ for f in trainer.reward_funcs] == ["char_count", "count_words"]
    assert any("rewards/char_count/mean" in entry for entry in trainer.state.log_history)
    before = load_file(str(Path(toy_models["qwen2"]) / "model.safetensors"))
    assert changed_tensors(before, load_file(str(out / "model.safetensors")))


@pytest.mark.slow  # a process of its own, or a real run
def test_kto_main_on_the_embedded_toy_default(tmp_path):
    """No model and no dataset: a toy model is built into `<output_dir>/toy-model` and trained on the toy data."""
    out = tmp_path / "out"
    trainer = main("kto", ["--output_dir", str(out)] + QUICK)

    assert_trained_and_saved(trainer, out, "kto")
    toy_dir = out / "toy-model"
    assert (toy_dir / "config.json").is_file() and (toy_dir / "tokenizer.json").is_file()
    assert changed_tensors(load_file(str(toy_dir / "model.safetensors")), load_file(str(out / "model.safetensors")))


def test_sft_main_on_the_embedded_toy_default(tmp_path):
    out = tmp_path / "out"
    trainer = main("sft", ["--output_dir", str(out)] + QUICK)

    assert_trained_and_saved(trainer, out, "sft")
    assert trainer.nan_guard is not None and type(trainer).__name__ == "SFTTrainer"
    toy_dir = out / "toy-model"
    assert changed_tensors(load_file(str(toy_dir / "model.safetensors")), load_file(str(out / "model.safetensors")))


def test_rloo_main_with_local_data_and_builtin_reward(toy_models, tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", toy.dataset_for("rloo"))
    out = tmp_path / "out"
    argv = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", data, "--output_dir", str(out),
            "--reward_funcs", "count_words", "--num_generations", "2", "--max_completion_length", "8"]  # fmt: skip
    trainer = main("rloo", argv + QUICK)

    assert_trained_and_saved(trainer, out, "rloo")
    assert [f.__name__ for f in trainer.reward_funcs] == ["count_words"]
    assert any("rewards/count_words/mean" in entry for entry in trainer.state.log_history)
    assert (out / "model.safetensors").is_file()  # (random completions score alike here: the weights may not move)


def test_model_without_dataset_is_an_error(toy_models, tmp_path):
    with pytest.raises(ValueError, match="`model_name_or_path` is set but `dataset_name` is not"):
        main("dpo", ["--model_name_or_path", toy_models["qwen2"], "--output_dir", str(tmp_path)] + QUICK)
    assert not (tmp_path / "toy-model").exists()


def test_parse_args_config_overrides_and_launcher_flags(tmp_path):
    config = tmp_path / "dpo.yaml"
    config.write_text("beta: 0.3\nlearning_rate: 2.0e-6\nsafety_mode: warn\nnan_snapshot_steps: 5\nlora_r: 8\n")
    script_args, args, model_args = parse_args(
        "dpo", ["--config", str(config), "--output_dir", str(tmp_path), "--beta", "0.5", "--local_rank=0"]
    )
    assert args.beta == 0.5  # the command line wins over the file
    assert args.learning_rate == 2e-6 and args.safety_mode == "warn" and args.nan_snapshot_steps == 5
    assert model_args.lora_r == 8
    assert args.local_rank == 0  # appended by the `deepspeed` launcher
    assert script_args.reward_funcs == ["count_words"]
    if not torch.cuda.is_available():
        assert args.use_cpu is True  # set automatically: transformers refuses bf16 on a CPU-only machine otherwise
        _, explicit, _ = parse_args("dpo", ["--output_dir", str(tmp_path), "--use_cpu", "false", "--bf16", "false"])
        assert explicit.use_cpu is False


def test_parse_args_rejects_unknown_flags(tmp_path):
    with pytest.raises(ValueError, match="no_such_flag"):
        parse_args("dpo", ["--output_dir", str(tmp_path), "--no_such_flag", "1"])
    with pytest.raises(ValueError, match="Unknown trainer kind"):
        parse_args("ppo", [])


def test_model_and_peft_fills_model_init_kwargs(toy_models, tmp_path):
    _, args, model_args = parse_args(
        "reward",
        ["--model_name_or_path", toy_models["qwen2-rm"], "--output_dir", str(tmp_path), "--dtype", "bfloat16",
         "--attn_implementation", "eager", "--use_peft", "--model_init_kwargs", '{"revision": "v1"}'],
    )  # fmt: skip
    model, args, peft_config = model_and_peft("reward", model_args, args)
    assert model == toy_models["qwen2-rm"]
    assert args.model_init_kwargs == {
        "revision": "v1",  # the user's own `model_init_kwargs` win
        "trust_remote_code": False,
        "attn_implementation": "eager",
        "dtype": "bfloat16",
    }
    assert peft_config.task_type == "CAUSAL_LM"  # as given: the safety rules fix it, and report the fix
    with pytest.raises(ValueError, match="`model_name_or_path` is not set"):
        model_and_peft("dpo", parse_args("dpo", ["--output_dir", str(tmp_path)])[2], args)


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet", "disk", "disk_dict"])
def test_load_train_dataset_from_local_sources(fmt, tmp_path):
    expected = toy.dataset_for("kto", n=6)
    split = "train"
    if fmt == "json":  # one JSON array
        path = tmp_path / "data.json"
        path.write_text(json.dumps(expected.to_list()))
    elif fmt == "jsonl":
        path = Path(write_jsonl(tmp_path / "data.jsonl", expected))
    elif fmt == "parquet":
        path = tmp_path / "data.parquet"
        expected.to_parquet(str(path))
    elif fmt == "disk":
        path = tmp_path / "saved"
        expected.save_to_disk(str(path))
    else:
        path, split = tmp_path / "saved_dict", "validation"
        DatasetDict({"train": toy.dataset_for("kto", n=3, seed=1), "validation": expected}).save_to_disk(str(path))
    script_args = ScriptArguments(dataset_name=str(path), dataset_train_split=split)
    loaded = load_train_dataset("kto", script_args)
    assert loaded.to_list() == expected.to_list()


def test_load_train_dataset_errors_and_toy_default(tmp_path):
    DatasetDict({"train": toy.dataset_for("dpo", n=2)}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"no split 'test'.*\['train'\]"):
        load_train_dataset("dpo", ScriptArguments(dataset_name=str(tmp_path / "saved"), dataset_train_split="test"))
    (tmp_path / "data.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match="unsupported extension '.csv'"):
        load_train_dataset("dpo", ScriptArguments(dataset_name=str(tmp_path / "data.csv")))
    # No dataset: the toy data for the kind, the same every time (all ranks must agree).
    assert load_train_dataset("grpo", ScriptArguments()).to_list() == toy.dataset_for("grpo").to_list()
    assert load_train_dataset("reward", ScriptArguments()).column_names == ["prompt", "chosen", "rejected"]


def test_unknown_reward_name_lists_the_builtins():
    with pytest.raises(ValueError, match="count_words, length, format") as error:
        rewards.load_reward_func("accuracy")
    assert "module:function" in str(error.value)
    with pytest.raises(ValueError, match="Could not import module `no_such_module_xyz`"):
        rewards.load_reward_func("no_such_module_xyz:reward")
    with pytest.raises(ValueError, match="no callable `nothing_here`"):
        rewards.load_reward_func("safe_trainers.scripts.rewards:nothing_here")
    with pytest.raises(ValueError, match="`reward_funcs` is empty"):
        rewards.load_reward_funcs([])


def test_builtin_rewards():
    assert rewards.load_reward_func("count_words") is rewards.count_words
    assert rewards.load_reward_func("safe_trainers.scripts.rewards:length") is rewards.length
    assert rewards.load_reward_func("safe_trainers.scripts.rewards.length") is rewards.length
    assert rewards.count_words(["yes good good", "no bad", "cat"]) == [3.0, -2.0, 0.0]
    chat = [[{"role": "assistant", "content": "yes good"}]]
    assert rewards.count_words(chat) == [2.0]
    assert rewards.length(["a " * 64, "a " * 96, "a " * 500]) == [0.0, -0.5, -1.0]
    assert rewards.length(["a b c"], max_words=2) == [-0.5]
    assert rewards.format(["<think>x</think> <answer>4</answer>", "4", "<answer>4</answer>"]) == [1.0, 0.0, 0.0]
    assert rewards.format.__name__ == "format"
    digits = rewards.make_format_reward(r"^\d+$", name="digits")
    assert digits(["42", "4x"]) == [1.0, 0.0] and digits.__name__ == "digits"
