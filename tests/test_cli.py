"""The `safe-trainers` command line: `rules`, `check` and `demo` (the OpenRLHF shim has its own test file)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from safe_trainers.cli.main import main
from safe_trainers.rules import rule_ids


def test_rules_lists_every_id(capsys):
    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    assert all(rule_id in out for rule_id in rule_ids())
    assert "kto.qwen2_no_vanilla_loss" in out  # the OpenRLHF shim's rules too


def write(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_check_unsafe_config_reports_and_fails(toy_models, tmp_path, capsys):
    config = write(
        tmp_path,
        f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nfp16: true\nmax_grad_norm: 0.0\n"
        "attn_implementation: flash_attention_2\n",
    )
    code = main(["check", "--trainer", "dpo", "--config", config, "--model", toy_models["gemma2"]])
    captured = capsys.readouterr()
    assert code == 1
    for rule_id in ("precision.bf16_over_fp16", "attention.gemma2_no_flash", "optim.grad_clip"):
        assert f"[fixed] {rule_id}" in captured.out
    assert "'flash_attention_2' -> 'eager'" in captured.out
    assert "strict" in captured.err


def test_check_clean_config_passes(toy_models, tmp_path, capsys):
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nlogging_nan_inf_filter: false\n")
    assert main(["check", "--trainer", "dpo", "--config", config, "--model", toy_models["qwen2"]]) == 0
    assert "all safety rules passed" in capsys.readouterr().out


def test_check_overrides_and_blocked(toy_models, tmp_path, capsys):
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nlogging_nan_inf_filter: false\n")
    argv = ["check", "--trainer", "kto", "--config", config, "--model", toy_models["qwen2"], "--", "--beta", "0"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "[blocked] dpo.beta_positive" in captured.out and "every safety mode" in captured.err


@pytest.mark.slow
def test_demo_runs_and_recovers(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "safe_trainers.cli.main", "demo", "--output-dir", str(tmp_path), "--no-compare"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[fixed] precision.bf16_over_fp16" in done.stderr + done.stdout
    assert "rollback" in done.stdout and "final weights finite: True" in done.stdout


def test_check_sft_fp16_on_gemma2(toy_models, tmp_path, capsys):
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nfp16: true\nmax_length: 512\n")
    assert main(["check", "--trainer", "sft", "--config", config, "--model", toy_models["gemma2"]]) == 1
    out = capsys.readouterr().out
    assert "safe_trainers (sft, safety_mode='fix')" in out and "[fixed] precision.bf16_over_fp16" in out


def test_check_rloo_groups(toy_models, tmp_path, capsys):
    base = f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nlogging_nan_inf_filter: false\n"
    good = write(tmp_path, base + "num_generations: 2\nper_device_train_batch_size: 2\n")
    assert main(["check", "--trainer", "rloo", "--config", good, "--model", toy_models["qwen2"]]) == 0
    assert "all safety rules passed" in capsys.readouterr().out
    bad = write(tmp_path, base + "num_generations: 1\n")  # refused by `RLOOConfig` itself: the config is invalid
    assert main(["check", "--trainer", "rloo", "--config", bad, "--model", toy_models["qwen2"]]) == 2
    assert "[grpo.group_size] `num_generations=1`" in capsys.readouterr().err
