"""`safe-trainers check` is a lint: it executes nothing (issue 28, section 2). With `trust_remote_code: true` in the
linted config it imported the model repository's `configuration_*.py`, and it applied the config's `env:` mapping to
its own process (TRL's parser does that while parsing). Now it reads `config.json` as data, says the model's code was
not run, runs it only with `--run-model-code`, and never applies `env:` (the launch scripts still do, as TRL)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from safe_trainers.cli.main import main


ROOT = Path(__file__).resolve().parents[2]
ENV_VAR = "SAFE_TRAINERS_CHECK_PROBE_VAR"
SECRET = "hf_checkProbeSecret0123456789abcdefXYZ"


def remote_code_model(toy_models: dict[str, str], root: Path, model_type: str) -> tuple[str, Path]:
    """A model folder whose `config.json` names its own `configuration_probe.py` (`auto_map`), which writes a marker
    file when it is imported; returns the folder and the marker's path."""
    folder, marker = root / f"remote-{model_type}", root / f"imported-{model_type}"
    shutil.copytree(toy_models["llama"], folder)  # the weights and tokenizer files of a saved model
    config = json.loads(Path(toy_models["llama"], "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_probe.ProbeConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_probe.py").write_text(
        "from pathlib import Path\n"
        "from transformers import LlamaConfig\n"
        f"Path({str(marker)!r}).write_text('imported')\n"
        "class ProbeConfig(LlamaConfig):\n"
        f"    model_type = {model_type!r}\n"
    )
    return str(folder), marker


def lint_config(tmp_path: Path) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(
        f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nlogging_nan_inf_filter: false\ntrust_remote_code: true\n"
        f"env:\n  {ENV_VAR}: set-by-the-config\n  HF_TOKEN: {SECRET}\n"
    )
    return str(path)


def check_process(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    env.pop(ENV_VAR, None)
    command = [sys.executable, "-m", "safe_trainers.cli.main", "check", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("model_type", ["lint_probe", "llama"])
def test_check_runs_no_model_code_and_applies_no_env_in_process(toy_models, tmp_path, capsys, model_type):
    # was: the marker written (the model's `configuration_probe.py` imported) and `SAFE_TRAINERS_CHECK_PROBE_VAR` set
    model, marker = remote_code_model(toy_models, tmp_path, model_type)
    os.environ.pop(ENV_VAR, None)
    try:
        code = main(["check", "--trainer", "dpo", "--config", lint_config(tmp_path), "--model", model])
        applied = os.environ.get(ENV_VAR)
    finally:
        os.environ.pop(ENV_VAR, None)
    out = capsys.readouterr()
    output = out.out + out.err
    assert not marker.exists(), output
    assert applied is None, output
    assert code == 0, output  # the rules it can run were run, and found nothing
    assert "safe_trainers (dpo" in output  # the report
    assert "the model's own code was not run" in output and "--run-model-code" in output
    assert "`env:` in the `--config` file was not applied" in output  # what it would set, said
    assert f"`{ENV_VAR}='set-by-the-config'`" in output and "`HF_TOKEN=<hidden>`" in output and SECRET not in output


def test_check_in_a_fresh_process_runs_no_model_code(toy_models, tmp_path):
    model, marker = remote_code_model(toy_models, tmp_path, "lint_probe")
    done = check_process(["--trainer", "dpo", "--config", lint_config(tmp_path), "--model", model], tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert not marker.exists(), output
    assert "the model's own code was not run" in output and SECRET not in output


def test_the_opt_in_runs_the_models_code(toy_models, tmp_path):
    model, marker = remote_code_model(toy_models, tmp_path, "lint_probe")
    args = ["--trainer", "dpo", "--config", lint_config(tmp_path), "--model", model, "--run-model-code"]
    done = check_process(args, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert marker.read_text() == "imported"
    assert "the model's own code was not run" not in output
    assert SECRET not in output  # `env:` is never applied nor shown, opt-in or not


@pytest.mark.parametrize("spelling", ["--trust_remote_code", "--trust-remote-code"])
def test_trls_trust_remote_code_override_is_the_setting_not_the_opt_in(toy_models, tmp_path, spelling):
    # The launch scripts take TRL's `--trust_remote_code` (either spelling, with or without a value) as the setting; so
    # does the check: it neither runs the model's code for it nor refuses its value.
    # was: taken as the check's own opt-in, so `--trust_remote_code` ran the model's code and `... true` exited 2
    model, marker = remote_code_model(toy_models, tmp_path, "lint_probe")
    for override in ([spelling], [spelling, "true"]):
        done = check_process(["--trainer", "dpo", "--config", lint_config(tmp_path), "--model", model, *override],
                             tmp_path)  # fmt: skip
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        assert not marker.exists(), output
        assert "the model's own code was not run" in output, output


def test_trust_remote_code_in_model_init_kwargs_is_read_as_data_too(toy_models, tmp_path):
    # TRL's trainers load the model with `model_init_kwargs`' own `trust_remote_code` (it wins over the setting), so
    # the check reads that model as one of `trust_remote_code: true`: as data, and says so.
    # was: "could not read `config.json`", and the model-specific rules were not checked
    model, marker = remote_code_model(toy_models, tmp_path, "lint_probe")
    config = tmp_path / "init-kwargs.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\n"
                      "model_init_kwargs:\n  trust_remote_code: true\n")  # fmt: skip
    done = check_process(["--trainer", "dpo", "--config", str(config), "--model", model], tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert not marker.exists(), output
    assert "the model's own code was not run" in output and "could not read `config.json`" not in output, output


def test_the_launch_scripts_still_apply_env_as_trl_does(tmp_path, monkeypatch):
    from safe_trainers.scripts.pipeline import parse_args

    for name in (ENV_VAR, "HF_TOKEN"):  # set then unset: the original state (unset or not) comes back afterwards
        monkeypatch.setenv(name, "before")
        monkeypatch.delenv(name)
    parse_args("dpo", ["--config", lint_config(tmp_path)], announce_cpu=False)
    assert os.environ.get(ENV_VAR) == "set-by-the-config"  # TRL's parser's behaviour, kept for training
