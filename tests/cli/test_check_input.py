"""`safe-trainers check` runs the launch scripts' input checks (issue 23, items 1 and 2): a bad value exits 2 with the
same message as the scripts, a model or dataset this machine lacks is a note (the run may train elsewhere), a negative
number after a space is a value, errors carry the check's own program name, and on a machine without the Hub it says
so in one line and answers at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from net_utils import free_port

from safe_trainers.cli.main import main


ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def check(args: list[str], **env: str | None) -> tuple[subprocess.CompletedProcess, str]:
    """`safe-trainers check <args>` in a fresh process, from the repo root."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    full_env = {name: value for name, value in full_env.items() if value is not None}
    command = [sys.executable, "-m", "safe_trainers.cli.main", "check", *args]
    done = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600)
    return done, done.stdout + done.stderr


@pytest.mark.slow  # a process of its own, or a real run
def test_a_negative_learning_rate_after_a_space_fails_check(tmp_path):
    # was: exit 0 with `--learning_rate=-1e-5`; 168 lines of usage under `train_dpo` with `--learning_rate -1e-5`
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\n")
    done, output = check(["--trainer", "dpo", "--config", config, "--learning_rate", "-1e-5"])
    assert done.returncode == 2, output
    assert "`learning_rate=-1e-05` is negative" in output and "train_dpo" not in output
    assert "Traceback" not in output and len(output.splitlines()) < 5


def test_a_usage_error_names_the_check_not_a_launch_script(tmp_path, capsys):
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\n")
    assert main(["check", "--trainer", "dpo", "--config", config, "--learning_rate", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("safe-trainers check: ") and "usage: train_dpo" not in err
    assert "invalid float value: 'fast'" in err and "`python launch/train_dpo.py --help`" in err


def test_a_model_path_that_does_not_exist_is_said(tmp_path, capsys):
    # was: "could not read `config.json`" only
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nlogging_nan_inf_filter: false\n")
    code = main(["check", "--trainer", "dpo", "--config", config, "--model", "./models/does-not-exist"])
    out = capsys.readouterr().out
    assert code == 0  # the lint is for the target, which may hold the model: noted, not failed
    assert "note: `model_name_or_path='./models/does-not-exist'` does not exist (nothing at" in out
    assert "could not read `config.json`" not in out


def test_a_missing_config_file_fails_with_the_scripts_message(tmp_path, capsys):
    assert main(["check", "--trainer", "dpo", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "`config=" in (err := capsys.readouterr().err) and "names no file" in err


@pytest.mark.slow  # a process of its own, or a real run
def test_a_shipped_config_without_the_hub_answers_offline_in_one_line(tmp_path):
    # was: 40-105 s of "Retrying in 8s" before the report
    env = {"HF_HUB_OFFLINE": None, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp_path)}
    done, output = check(["--trainer", "dpo", "--config", "configs/trainers/dpo.yaml"], **env)
    assert done.returncode == 0, output
    assert output.count("cannot be reached from this machine") == 1 and "so working offline" in output
    assert "Retrying" not in output and "Traceback" not in output
    assert "`Qwen/Qwen2.5-0.5B-Instruct` is a `qwen2` model, inferred from the name" in output


@pytest.mark.slow  # a process of its own, or a real run
def test_the_users_hf_hub_offline_is_honoured_without_a_probe(tmp_path):
    with socket.socket() as listener:  # a Hub endpoint that would see the probe's connection
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        env = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://127.0.0.1:{listener.getsockname()[1]}",
               "HF_HOME": str(tmp_path)}  # fmt: skip
        done, output = check(["--trainer", "dpo", "--config", "configs/trainers/dpo.yaml"], **env)
        assert done.returncode == 0, output
        assert "`HF_HUB_OFFLINE` is set, so working offline" in output
        assert not accepted(listener)


def test_local_paths_never_touch_the_network(toy_models, tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    config = write(tmp_path, f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nlogging_nan_inf_filter: false\n"
                             f"model_name_or_path: {toy_models['qwen2']}\ndataset_name: {data}\n")  # fmt: skip
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        env = {"HF_HUB_OFFLINE": None, "HF_ENDPOINT": f"http://127.0.0.1:{listener.getsockname()[1]}"}
        done, output = check(["--trainer", "dpo", "--config", config], **env)
        assert done.returncode == 0, output
        assert "offline" not in output
        assert not accepted(listener)  # no probe, no lookup: nothing connected to the endpoint


def accepted(listener: socket.socket) -> bool:
    try:
        connection, _ = listener.accept()
    except TimeoutError:
        return False
    connection.close()
    return True
