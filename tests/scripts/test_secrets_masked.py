"""Errors and reports do not repeat secrets (issue 28, section 2): a misspelt `hub_tokn: hf_...` was echoed word for
word in the input error. A setting whose name looks like a credential (or whose value looks like a known token) is
shown as `<hidden>` in every message and report; a tokenizer's `pad_token` or a `max_tokens` count is still shown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from safe_trainers.cli.main import main as cli
from safe_trainers.redact import looks_like_secret, mask_secret
from safe_trainers.rules.report import Change, Finding, SafetyReport
from safe_trainers.scripts.entry import run


ROOT = Path(__file__).resolve().parents[2]
SECRET = "hf_maskProbe0123456789abcdefghijKLMNOP"

CREDENTIAL_NAMES = [
    "hub_token", "HF_TOKEN", "hf_hub_token", "wandb_api_key", "WANDB_API_KEY", "api_key", "apiKey", "OPENAI_API_KEY",
    "AWS_SECRET_ACCESS_KEY", "secret", "client_secret", "password", "db_password", "DB_PASSWD", "auth", "hub_auth",
    "use_auth_token", "push_to_hub_token", "access_token", "GITHUB_TOKEN", "credentials", "hfToken",
    "hub_tokn", "hub_tokne", "hub_toekn", "pasword",  # misspelt: still a credential's name
]  # fmt: skip
PLAIN_NAMES = [
    "max_tokens", "pad_token", "eos_token", "bos_token", "unk_token", "max_new_tokens", "tokenizer", "tokenizer_name",
    "token_level_kl", "keyword", "keywords", "average_tokens_across_devices", "include_num_input_tokens_seen",
    "pad_token_id", "sort_key", "hub_token_path", "dataset_text_field", "learning_rate", "passes", "author",
]  # fmt: skip


@pytest.mark.parametrize("name", CREDENTIAL_NAMES)
def test_a_credentials_name_is_recognised(name):
    assert looks_like_secret(name)
    assert SECRET not in repr(mask_secret(name, SECRET))


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_a_plain_settings_name_is_not_taken_for_a_credential(name):
    assert not looks_like_secret(name)
    assert mask_secret(name, "<|pad|>") == "<|pad|>"


def test_flags_and_nested_values_are_masked_too():
    assert mask_secret("use_auth_token", True) is True  # a switch holds no credential
    assert mask_secret("--hub-token", SECRET) != SECRET
    assert mask_secret("argument", SECRET) != SECRET  # a known token's shape, whatever the name
    masked = mask_secret("model_init_kwargs", {"token": SECRET, "revision": "main", "pad_token": "<pad>"})
    assert masked["revision"] == "main" and masked["pad_token"] == "<pad>" and SECRET not in repr(masked)


def config_with(tmp_path: Path, toy_models, **lines: str) -> str:
    path = tmp_path / "config.yaml"
    text = f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nlogging_nan_inf_filter: false\n"
    text += f"model_name_or_path: {toy_models['qwen2']}\n" + "".join(f"{k}: {v}\n" for k, v in lines.items())
    path.write_text(text)
    return str(path)


def assert_masked(text: str, *fragments: str) -> None:
    assert SECRET not in text and SECRET[:12] not in text, text
    for fragment in fragments:
        assert fragment in text, text


def test_a_misspelt_token_in_the_config_file_is_named_not_repeated(toy_models, tmp_path, capsys):
    # was: "`hub_tokn='hf_...'` in the `--config` file is not a setting of this launch ..."
    config = config_with(tmp_path, toy_models, hub_tokn=SECRET)
    with pytest.raises(SystemExit) as exited:
        run("dpo", ["--config", config])
    assert exited.value.code == 2
    assert_masked(capsys.readouterr().err, "`hub_tokn=<hidden>`", "Did you mean `hub_token`?")
    assert cli(["check", "--trainer", "dpo", "--config", config]) == 2
    assert_masked(capsys.readouterr().err, "safe-trainers check", "`hub_tokn=<hidden>`", "Did you mean `hub_token`?")


def test_a_misspelt_token_on_the_command_line_is_named_not_repeated(toy_models, tmp_path, capsys):
    config = config_with(tmp_path, toy_models)
    for argv in (["--hub_tokn", SECRET], [f"--hub-tokn={SECRET}"]):
        with pytest.raises(SystemExit):
            run("dpo", ["--config", config, *argv])
        assert_masked(capsys.readouterr().err, "`hub_tokn=<hidden>`", "Did you mean `hub_token`?")
        assert cli(["check", "--trainer", "dpo", "--config", config, *argv]) == 2
        assert_masked(capsys.readouterr().err, "`hub_tokn=<hidden>`")


def test_a_launch_script_in_a_fresh_process_does_not_repeat_it(toy_models, tmp_path):
    config = config_with(tmp_path, toy_models, hub_tokn=SECRET)
    done = subprocess.run([sys.executable, "launch/train_dpo.py", "--config", config], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert_masked(done.stdout + done.stderr, "train_dpo: error:", "`hub_tokn=<hidden>`")


def test_a_correctly_named_secret_in_a_report_is_masked(tmp_path):
    change = Change("args.hub_token", None, SECRET)
    kwargs = Change("args.model_init_kwargs", {"token": SECRET}, {"token": SECRET, "dtype": "bfloat16"})
    flag = Change("argv.--wandb_api_key", SECRET, "x" * 40)
    report = SafetyReport("dpo", "fix", [Finding("probe.rule", "fixed", "probe", (change, kwargs, flag))])
    path = report.write_json(str(tmp_path))
    assert_masked(report.render(), "args.hub_token: None -> <hidden>", "'dtype': 'bfloat16'")
    assert_masked(Path(path).read_text())
    data = json.loads(Path(path).read_text())
    assert data["findings"][0]["changes"][0]["new"] == "<hidden>"
    assert data["findings"][0]["changes"][1]["new"]["dtype"] == "bfloat16"


def test_check_does_not_repeat_a_correctly_named_token(toy_models, tmp_path, capsys):
    config = config_with(tmp_path, toy_models, hub_token=SECRET, env=f"{{HF_TOKEN: {SECRET}}}")
    assert cli(["check", "--trainer", "dpo", "--config", config]) == 0
    out = capsys.readouterr()
    assert_masked(out.out + out.err, "`HF_TOKEN=<hidden>`")


def test_a_token_in_an_error_of_trls_parser_is_not_repeated(toy_models, tmp_path, capsys):
    # A token given to the wrong flag: argparse's own error quotes the value.
    # was: "invalid int value: 'hf_...'" printed word for word by `check`
    config = tmp_path / "c.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\n")
    code = cli(["check", "--trainer", "dpo", "--config", str(config), "--model", toy_models["qwen2"],
                "--max_steps", SECRET])  # fmt: skip
    out = capsys.readouterr()
    assert code == 2 and "--max_steps" in out.err and "<hidden>" in out.err, out.err
    assert SECRET not in out.out + out.err


def test_a_password_in_a_url_is_hidden_and_the_rest_shown(toy_models, tmp_path, capsys):
    # was: the note quoted `https://reader:pw-Probe123@...` whole
    config = tmp_path / "c.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\n"
                      "dataset_name: https://reader:pw-Probe123@data.example/d.json\n")  # fmt: skip
    cli(["check", "--trainer", "dpo", "--config", str(config), "--model", toy_models["qwen2"]])
    out = capsys.readouterr()
    assert "pw-Probe123" not in out.out + out.err
    assert "https://reader:<hidden>@data.example/d.json" in out.out + out.err, out.out + out.err
    assert mask_secret("dataset_name", "https://data.example/d.json") == "https://data.example/d.json"
