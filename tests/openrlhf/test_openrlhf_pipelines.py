"""The OpenRLHF commands of whole pipelines, not only the trainers (issue 12, items 5 and 6): serving a reward model
(`serve_rm`, remote-RM PPO), batch generation and scoring (`batch_inference`, rejection sampling and iterative DPO),
other `openrlhf.cli` modules, and commands whose flags fit several OpenRLHF generations. Commands are written in the
style of OpenRLHF's example scripts."""

from __future__ import annotations

import subprocess

import pytest

from safe_trainers.errors import SafetyError
from safe_trainers.openrlhf import parse_command, sanitize, shim
from safe_trainers.openrlhf.command import CommandView
from safe_trainers.openrlhf.flags import resolve
from safe_trainers.rules.report import REMOVED, Change


PY = ["python", "-m"]
DS = ["deepspeed", "--module"]
GEMMA_RM = "google/gemma-2-27b-rm"  # recognised from its name (nothing local is named like this)


@pytest.fixture(autouse=True)
def no_installed_openrlhf(monkeypatch):
    monkeypatch.setattr(shim, "installed_openrlhf_version", lambda: None)
    monkeypatch.setattr(shim, "local_bf16_support", lambda: None)


class Recorder:
    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        self.calls.append(argv)
        return subprocess.CompletedProcess(argv, 0)


UNCHANGED = [
    # remote reward model for PPO, <= 0.8.9 flags
    [*PY, "openrlhf.cli.serve_rm", "--reward_pretrain", "OpenRLHF/Llama-3-8b-rm-mixture", "--port", "5000", "--bf16",
     "--flash_attn", "--normalize_reward", "--max_len", "8192", "--batch_size", "16"],
    # the same, >= 0.10.2 flags
    [*PY, "openrlhf.cli.serve_rm", "--reward.model_name_or_path", "OpenRLHF/Llama-3-8b-rm-mixture", "--port", "5000",
     "--ds.attn_implementation", "flash_attention_2", "--ds.packing_samples"],
    # rejection sampling: generate with vLLM, then score with the reward model
    [*DS, "openrlhf.cli.batch_inference", "--eval_task", "generate_vllm", "--pretrain",
     "meta-llama/Meta-Llama-3-8B-Instruct", "--bf16", "--max_new_tokens", "2048", "--prompt_max_len", "2048",
     "--dataset", "OpenRLHF/prompt-collection-v0.1", "--input_key", "context_messages", "--apply_chat_template",
     "--temperature", "0.9", "--best_of_n", "4", "--tp_size", "4", "--output_path", "generate.jsonl"],
    [*DS, "openrlhf.cli.batch_inference", "--eval_task", "rm", "--pretrain", "OpenRLHF/Llama-3-8b-rm-mixture",
     "--bf16", "--max_len", "4096", "--dataset", "generate.jsonl", "--dataset_probs", "1.0", "--zero_stage", "0",
     "--post_processor", "rs", "--micro_batch_size", "4", "--output_path", "rm.jsonl"],
    # iterative DPO's scoring step, 0.9.2-0.9.5 flags
    [*DS, "openrlhf.cli.batch_inference", "--eval_task", "rm", "--pretrain", "OpenRLHF/Llama-3-8b-rm-mixture",
     "--param_dtype", "bf16", "--attn_implementation", "flash_attention_2", "--output_path", "rm.jsonl"],
    # not a model-loading entry point the rules know: run as given
    [*PY, "openrlhf.cli.lora_combiner", "--model_path", "meta-llama/Meta-Llama-3-8B", "--lora_path", "ckpt/lora",
     "--output_path", "ckpt/merged", "--bf16"],
]  # fmt: skip


@pytest.mark.parametrize("command", UNCHANGED, ids=lambda c: c[2] + "-" + "-".join(c[3:5]))
def test_pipeline_commands_run_unchanged(command, capsys):
    runner = Recorder()
    assert shim.run(command, runner=runner) == 0  # was 2: "not an OpenRLHF trainer this shim knows"
    assert runner.calls == [command]


@pytest.mark.parametrize(
    "command, fixed, changes",
    [
        (
            [*PY, "openrlhf.cli.serve_rm", "--reward_pretrain", GEMMA_RM, "--port", "5000", "--bf16", "--flash_attn",
             "--packing_samples"],
            [*PY, "openrlhf.cli.serve_rm", "--reward_pretrain", GEMMA_RM, "--port", "5000", "--bf16"],
            [Change("argv.--flash_attn", True, REMOVED), Change("argv.--packing_samples", True, REMOVED)],
        ),
        (
            [*PY, "openrlhf.cli.serve_rm", "--reward_pretrain", GEMMA_RM, "--param_dtype", "fp16"],
            [*PY, "openrlhf.cli.serve_rm", "--reward_pretrain", GEMMA_RM, "--param_dtype", "bf16",
             "--attn_implementation", "eager"],
            [Change("argv.--param_dtype", "fp16", "bf16"), Change("argv.--attn_implementation", REMOVED, "eager")],
        ),
        (
            [*PY, "openrlhf.cli.serve_rm", "--reward.model_name_or_path", GEMMA_RM, "--ds.param_dtype", "fp16"],
            [*PY, "openrlhf.cli.serve_rm", "--reward.model_name_or_path", GEMMA_RM, "--ds.param_dtype", "bf16",
             "--ds.attn_implementation", "eager"],
            [
                Change("argv.--ds.param_dtype", "fp16", "bf16"),
                Change("argv.--ds.attn_implementation", REMOVED, "eager"),
            ],
        ),
        (
            [*DS, "openrlhf.cli.batch_inference", "--eval_task", "rm", "--pretrain", GEMMA_RM, "--bf16",
             "--flash_attn", "--output_path", "rm.jsonl"],
            [*DS, "openrlhf.cli.batch_inference", "--eval_task", "rm", "--pretrain", GEMMA_RM, "--bf16",
             "--output_path", "rm.jsonl"],
            [Change("argv.--flash_attn", True, REMOVED)],
        ),
    ],
    ids=["serve-legacy-flash", "serve-fp16", "serve-dotted-fp16", "score-legacy-flash"],
)
def test_a_gemma2_reward_model_is_served_safely(command, fixed, changes):
    result = shim.plan(command)
    assert result.argv == fixed and result.report.changes == changes
    # Every flag of the rewritten command resolves to the same flag in the generation the rules used.
    view = CommandView(parse_command(fixed), result.generations[0])
    assert all(resolve(n, view.generation, view.entry) in (n, None) for n in parse_command(fixed).option_names())


def test_an_ambiguous_command_gets_the_fix_every_candidate_accepts():
    # `--bf16` and `--packing_samples` fit <= 0.8.9 and 0.8.10-0.9.1; the grad-clip fix is the same in both: applied.
    command = [*DS, "openrlhf.cli.train_sft", "--pretrain", "Qwen/Qwen2.5-7B", "--bf16", "--max_norm", "0"]
    argv, report = sanitize(command)
    assert argv == [*DS, "openrlhf.cli.train_sft", "--pretrain", "Qwen/Qwen2.5-7B", "--bf16", "--max_norm", "1.0"]
    assert [f.action for f in report.findings] == ["fixed"]


def test_an_ambiguous_gemma2_command_is_refused_with_the_fix_for_each_release():
    command = [*DS, "openrlhf.cli.train_sft", "--pretrain", "google/gemma-2-9b-it", "--bf16", "--packing_samples"]
    with pytest.raises(SafetyError) as error:  # was: exit 0 with a warning, packing kept
        sanitize(command)
    message = str(error.value)
    assert "Valid in every candidate release: argv.--packing_samples: True -> <removed>" in message
    assert "OpenRLHF 0.8.10-0.9.1 needs argv.--attn_implementation: <removed> -> 'eager'" in message
    assert "--openrlhf-version" in message
    assert sanitize(command, version="0.8.9")[0] == command[:-1]
    assert sanitize(command, version="0.9.1")[0] == [*command[:-1], "--attn_implementation", "eager"]


# Releases up to 0.3.5 had no `openrlhf.cli`: every step was a script of `examples/`, started from
# `examples/scripts/` as `deepspeed ../batch_inference.py ...` or `python ../batch_inference.py ...` (their shell
# scripts build the command in a heredoc and let the shell split it). Commands in the style of those scripts.
SCRIPT_FORMS = [
    # rejection sampling: generate with vLLM (plain `python`: vLLM starts its own workers) ...
    ["python", "../batch_inference.py", "--eval_task", "generate_vllm", "--pretrain",
     "OpenLLMAI/Llama-3-8b-sft-mixture", "--bf16", "--max_new_tokens", "1024", "--prompt_max_len", "1024",
     "--dataset", "OpenLLMAI/prompt-collection-v0.1",
     "--input_key", "context_messages", "--apply_chat_template", "--temperature", "0.9", "--zero_stage", "0",
     "--best_of_n", "4", "--enable_prefix_caching", "--tp_size", "2", "--max_num_seqs", "64", "--iter", "0",
     "--rollout_batch_size", "1024", "--output_path", "ckpt/generate.jsonl"],
    # ... then score the samples with the reward model
    ["deepspeed", "../batch_inference.py", "--eval_task", "rm", "--pretrain", "OpenLLMAI/Llama-3-8b-rm-mixture",
     "--bf16", "--max_len", "4096", "--dataset", "ckpt/generate.jsonl", "--dataset_probs", "1.0", "--zero_stage", "0",
     "--post_processor", "rs", "--micro_batch_size", "4", "--output_path", "ckpt/rm.jsonl"],
    # conditional SFT: score the chosen answers, normalised
    ["deepspeed", "--include", "localhost:0,1", "../batch_inference.py", "--eval_task", "rm", "--pretrain",
     "OpenLLMAI/Llama-3-8b-rm-mixture", "--bf16", "--max_len", "4096", "--dataset", "OpenLLMAI/preference_mix",
     "--input_key", "chosen", "--apply_chat_template", "--max_samples", "64000", "--zero_stage", "0",
     "--post_processor", "csft", "--normalize_reward", "--micro_batch_size", "4", "--output_path", "ckpt/rm.jsonl"],
    # 0.1.x generation with DeepSpeed inference, flash attention on a Llama (no soft-cap: nothing to change)
    ["deepspeed", "examples/batch_inference.py", "--eval_task", "generate", "--pretrain", "meta-llama/Llama-2-7b-hf",
     "--bf16", "--flash_attn", "--max_len", "2048", "--dataset", "Open-Orca/OpenOrca", "--greedy_sampling",
     "--micro_batch_size", "16", "--output_path", "ckpt/out.jsonl"],
    # chatting with a trained checkpoint: no rule reads this entry point, it runs as given
    ["deepspeed", "../interactive_chat.py", "--pretrain", "meta-llama/Llama-2-7b-chat-hf", "--bf16", "--load_model",
     "ckpt/7b_llama"],
]  # fmt: skip


@pytest.mark.parametrize("command", SCRIPT_FORMS, ids=["generate-vllm", "score-rs", "score-csft", "generate", "chat"])
def test_pre_cli_script_forms_of_pipeline_steps_run(command, capsys):
    runner = Recorder()
    assert shim.run(command, runner=runner) == 0  # was 2: "no OpenRLHF entry point in the command"
    assert runner.calls == [command]
    err = capsys.readouterr().err
    if "interactive_chat" in command[1]:
        assert "no rule applies to `../interactive_chat.py`" in err
    else:
        assert "batch_inference.py` with the flag names of OpenRLHF <=0.8.9" in err


@pytest.mark.parametrize(
    "command, fixed",
    [
        (  # flash attention on a soft-capped Gemma-2 reward model: removed, as for `openrlhf.cli.batch_inference`
            ["deepspeed", "../batch_inference.py", "--eval_task", "rm", "--pretrain", GEMMA_RM, "--bf16",
             "--flash_attn", "--micro_batch_size", "4", "--output_path", "rm.jsonl"],
            ["deepspeed", "../batch_inference.py", "--eval_task", "rm", "--pretrain", GEMMA_RM, "--bf16",
             "--micro_batch_size", "4", "--output_path", "rm.jsonl"],
        ),
        (  # a unique prefix, as argparse takes it (`--fl` is `--flash_attn` in every release's batch_inference.py)
            ["python", "examples/batch_inference.py", "--eval_task", "rm", "--pretrain", GEMMA_RM, "--fl", "--bf16"],
            ["python", "examples/batch_inference.py", "--eval_task", "rm", "--pretrain", GEMMA_RM, "--bf16"],
        ),
        (  # no attention flag: in those releases eager was the default, so Gemma-2 is safe as written
            ["python", "../batch_inference.py", "--eval_task", "rm", "--pretrain", GEMMA_RM, "--bf16"],
            ["python", "../batch_inference.py", "--eval_task", "rm", "--pretrain", GEMMA_RM, "--bf16"],
        ),
        (  # the same holds for the trainers' scripts (was refused: `--bf16` alone also fits 0.8.10-0.9.1)
            ["deepspeed", "../train_rm.py", "--pretrain", "google/gemma-2-9b", "--bf16", "--max_norm", "1.0"],
            ["deepspeed", "../train_rm.py", "--pretrain", "google/gemma-2-9b", "--bf16", "--max_norm", "1.0"],
        ),
    ],
    ids=["score-flash", "score-prefix", "score-default-eager", "train-default-eager"],
)
def test_script_forms_are_read_with_the_flags_of_their_releases(command, fixed):
    result = shim.plan(command)
    assert result.argv == fixed
    assert [str(g) for g in result.generations] == ["<=0.8.9"] and command[1] in result.version_source


def test_a_script_form_with_flags_of_a_later_release_is_refused(capsys):
    command = ["python", "../batch_inference.py", "--eval_task", "rm", "--pretrain", GEMMA_RM, "--param_dtype", "bf16"]
    runner = Recorder()
    assert shim.run(command, runner=runner) == 2 and runner.calls == []
    err = capsys.readouterr().err
    assert "`--param_dtype` does not fit the other flags" in err and "`../batch_inference.py` (<=0.8.9)" in err
    # A module file run by its path is not an `examples/` script: its flags tell the release, as for the module
    # (0.9.2-0.10.1, where flash attention is the default: eager is set for the Gemma-2 reward model).
    module_file = ["python", "site-packages/openrlhf/cli/batch_inference.py", *command[2:]]
    assert shim.plan(module_file).argv[-4:] == ["--param_dtype", "bf16", "--attn_implementation", "eager"]
