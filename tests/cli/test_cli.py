"""The `safe-trainers` command line: `rules`, `check` and `demo` (the OpenRLHF shim has its own test file)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from safe_trainers.arguments import SafetyArguments
from safe_trainers.cli.main import main
from safe_trainers.guard.snapshot_interval import describe as describe_snapshots
from safe_trainers.rules import DEFAULT_RULES, rule_ids
from safe_trainers.rules.report import SafetyReport


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
    argv = ["check", "--trainer", "kto", "--config", config, "--model", toy_models["qwen2"], "--", "--beta", "nan"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "[blocked] dpo.beta_positive" in captured.out and "every safety mode" in captured.err


def test_check_overrides_without_a_double_dash(toy_models, tmp_path, capsys):
    # the README's form; argparse used to reject it with "unrecognized arguments: --fp16 true"
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nlogging_nan_inf_filter: false\n")
    code = main(["check", "--trainer", "dpo", "--config", config, "--model", toy_models["qwen2"], "--fp16", "true"])
    assert code == 1
    out = capsys.readouterr().out
    assert "[fixed] precision.bf16_over_fp16  `fp16=True` switched to bf16" in out


def test_check_rejects_unknown_arguments_for_other_commands():
    with pytest.raises(SystemExit) as exc:
        main(["rules", "--fp16", "true"])
    assert exc.value.code == 2


def test_check_trains_nothing_and_says_which_hardware_it_assumed(toy_models, tmp_path, capsys, caplog):
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nlogging_nan_inf_filter: false\n")
    assert main(["check", "--trainer", "dpo", "--config", config, "--model", toy_models["qwen2"]]) == 0
    captured = capsys.readouterr()
    assert "hardware assumed: a CUDA GPU with bf16 (Ampere or newer)" in captured.out
    assert "`--target-hardware`" in captured.out
    assert "training on the CPU" not in captured.out + captured.err + caplog.text


def test_check_for_a_gpu_without_bf16(toy_models, tmp_path, capsys):
    # on a V100 an fp16 Gemma-2 run must go to fp32, not to bf16 (this machine's CPU has bf16; the V100 has not)
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nfp16: true\nlogging_nan_inf_filter: false\n")
    argv = ["check", "--trainer", "dpo", "--config", config, "--model", toy_models["gemma2"]]
    argv += ["--target-hardware", "V100"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "hardware assumed: NVIDIA V100 (bf16: no" in out
    assert "switched to fp32: this device has no bf16 and `gemma2`" in out
    assert "args.bf16" not in out and "args.use_cpu" not in out


def test_check_bf16_config_for_a_gpu_without_bf16_is_warned(toy_models, tmp_path, capsys):
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nbf16: true\nlogging_nan_inf_filter: false\n")
    argv = ["check", "--trainer", "dpo", "--config", config, "--model", toy_models["qwen2"], "--target-hardware", "T4"]
    assert main(argv) == 1
    assert "[warned] precision.bf16_supported  `bf16=True` on NVIDIA T4" in capsys.readouterr().out


def test_check_h20_with_cuda_12_1_is_refused(toy_models, tmp_path, capsys):
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nlogging_nan_inf_filter: false\nnum_generations: 2\n")
    argv = ["check", "--trainer", "grpo", "--config", config, "--model", toy_models["qwen2"],
            "--target-hardware", "H20", "--cuda-version", "12.1", "--per_device_train_batch_size", "2"]  # fmt: skip
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "hardware assumed: NVIDIA H20 (bf16: yes, CUDA 12.1)" in captured.out
    assert "[blocked] env.cublas_sigfpe" in captured.out and "nvidia-cublas-cu12>=12.4.5.8" in captured.out
    assert "would stop construction in every safety mode" in captured.err
    argv += ["--cublas-version", "12.4.5.8"]
    assert main(argv) == 0


def test_check_reads_mixed_precision_from_the_accelerate_config(toy_models, tmp_path, capsys):
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nbf16: false\nlogging_nan_inf_filter: false\n")
    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text("distributed_type: MULTI_GPU\nmixed_precision: fp16\nnum_processes: 8\n")
    argv = ["check", "--trainer", "dpo", "--config", config, "--model", toy_models["qwen2"],
            "--accelerate-config", str(accelerate)]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "accelerate's `mixed_precision='fp16'`" in out and "args.mixed_precision: 'fp16' -> 'bf16'" in out


def test_check_ignores_this_shells_accelerate_precision(toy_models, tmp_path, capsys, monkeypatch):
    # The lint is for the described launch: the shell's `ACCELERATE_MIXED_PRECISION` is not the target's.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nbf16: false\nlogging_nan_inf_filter: false\n")
    assert main(["check", "--trainer", "dpo", "--config", config, "--model", toy_models["qwen2"]]) == 0
    assert "mixed_precision" not in capsys.readouterr().out


def test_check_unknown_gpu_needs_bf16_support(tmp_path, capsys):
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\n")
    assert main(["check", "--trainer", "dpo", "--config", config, "--target-hardware", "Mystery 9000"]) == 2
    assert "--bf16-supported" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_runs_and_recovers(tmp_path):
    # The README's demo command as written (with the stock TRL comparison), only the output directory chosen.
    done = subprocess.run(
        [sys.executable, "-m", "safe_trainers.cli.main", "demo", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[fixed] precision.bf16_over_fp16" in done.stderr + done.stdout
    assert "rollback" in done.stdout and "final weights finite: True" in done.stdout
    assert "stock TRL final weights finite: False" in done.stdout
    # What the user sees reads as a story (issue 23): the report the README shows, no deprecation notice caused by the
    # demo's settings, and step 9 skipped, then its damaged state restored, with nothing applied thrown away.
    assert readme_report() in done.stderr
    assert "FutureWarning" not in done.stderr, done.stderr[:3000]
    assert "no applied update is discarded (step 9 was skipped)" in done.stdout + done.stderr
    assert "Training goes on with step 10." in done.stderr and "steps 9-9" not in done.stdout + done.stderr


def readme_report() -> str:
    """The report the README shows (the first fenced block that starts with `safe_trainers (dpo, ...`)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return re.search(r"```\n(safe_trainers \(dpo, safety_mode='fix'\).*?)\n```", readme, re.DOTALL).group(1)


def test_the_readme_shows_the_report_the_demo_prints(tmp_path):
    # The README's sample lacked the demo's `1 warned`; and building the demo's trainer raised transformers'
    # `gradient_checkpointing is deprecated` FutureWarning from the demo's own settings.
    from safe_trainers.cli.demo_run import unsafe_trainer
    from safe_trainers.testing.toy import dataset_for, save_toy_model

    model = save_toy_model(str(tmp_path / "tiny-gemma2"), "gemma2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = unsafe_trainer(model, str(tmp_path / "safe"), 12, dataset_for("dpo", 64))
    assert trainer.safety_report.render() == readme_report()
    deprecated = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert not deprecated, deprecated


def test_the_readme_shows_the_one_line_of_a_clean_construction():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = re.search(r"```\n(safe_trainers \(dpo\): \d+ safety rules run.*?)\n```", readme).group(1)
    dpo_rules = sum("dpo" in rule.trainers for rule in DEFAULT_RULES)
    snapshots = describe_snapshots(SafetyArguments(), SimpleNamespace(save_strategy="steps", save_steps=500))
    report = SafetyReport("dpo", "fix")
    assert line == report.construction_summary(dpo_rules, True, "out/dpo/safety_report.json", snapshots)


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
