"""The launch scripts as programs: a user's mistake is one message and exit status 2, never a traceback, and a bug
keeps its traceback (issue 23, item 1). The inputs each check refuses, in process: `test_refused_inputs.py`.

Each row of the issue's table, run as a user runs it: `python launch/train_dpo.py ... --max_steps 2` in a fresh
process, on a tiny local model and local JSONL files. Before the fix each of these ended in a Python traceback
(exit 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from net_utils import free_port

from safe_trainers.scripts.inputs import InputError
from safe_trainers.testing import toy


ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]  # = `accelerate launch`
QUICK = ["--max_steps", "2", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def train_dpo(args: list[str], tmp_path: Path, launcher: list[str] | None = None, **env: str | None):
    """`python launch/train_dpo.py <args> --output_dir <tmp> --max_steps 2 ...` from the repo root; the finished
    process and its whole output."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    full_env = {name: value for name, value in full_env.items() if value is not None}  # `None`: unset
    command = [*(launcher or [sys.executable]), "launch/train_dpo.py", *args, "--output_dir", str(tmp_path / "out")]
    done = subprocess.run(command + QUICK, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600)
    return done, done.stdout + done.stderr


def assert_refused(done, output: str, *fragments: str) -> None:
    """Exit 2, one `train_dpo: error:` message holding every fragment, no traceback, no weight loaded."""
    assert done.returncode == 2, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert output.count("train_dpo: error:") == 1, output[-4000:]
    message = output[output.index("train_dpo: error:") :]
    for fragment in fragments:
        assert fragment in message, message


@pytest.fixture
def prefs(tmp_path) -> str:
    return write_jsonl(tmp_path / "prefs.jsonl", toy.dataset_for("dpo").to_list())


@pytest.mark.slow  # a process of its own, or a real run
def test_a_model_path_that_does_not_exist(prefs, tmp_path):
    done, output = train_dpo(["--model_name_or_path", "models/does-not-exist", "--dataset_name", prefs], tmp_path)
    # was: OSError "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"
    assert_refused(done, output, "`model_name_or_path='models/does-not-exist'`", "is not a local directory",
                   "models/does-not-exist", "`save_pretrained`")  # fmt: skip
    assert "Loading weights" not in output


@pytest.mark.slow  # a process of its own, or a real run
def test_a_missing_config_file(tmp_path):
    done, output = train_dpo(["--config", "missing.yaml"], tmp_path)  # was: FileNotFoundError from TRL's parser
    assert_refused(done, output, "`config='missing.yaml'`", "names no file", "configs/trainers/dpo.yaml")


@pytest.mark.slow  # a process of its own, or a real run
def test_an_unknown_rule_id_to_disable(tmp_path):
    done, output = train_dpo(["--safety_disable_rules", "optim.nope"], tmp_path)  # was: the same text in a traceback
    assert_refused(done, output, "`safety_disable_rules`", "['optim.nope']", "optim.grad_clip")


@pytest.mark.slow  # a process of its own, or a real run
@pytest.mark.parametrize("form", [["--learning_rate=-1e-5"], ["--learning_rate", "-1e-5"]], ids=["equals", "space"])
def test_a_negative_learning_rate_before_any_model(form, tmp_path):
    # was: torch's "Invalid learning rate" after the model loaded (`=`), or argparse's usage of every option (space)
    done, output = train_dpo(form, tmp_path)
    assert_refused(done, output, "`learning_rate=-1e-05` is negative", "--learning_rate 1e-5")
    assert not (tmp_path / "out" / "toy-model").exists()  # refused before even the toy model was built


def test_an_empty_jsonl(toy_models, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    args = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", str(tmp_path / "empty.jsonl")]
    done, output = train_dpo(args, tmp_path)  # was: a bare StopIteration from datasets
    assert_refused(done, output, "`dataset_name=", "empty.jsonl", "is an empty file")


def test_a_jsonl_without_the_chosen_column(toy_models, tmp_path):
    rows = [{"prompt": "Is it good?", "answer": "yes", "rejected": "no"}] * 4
    args = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", write_jsonl(tmp_path / "qa.jsonl", rows)]
    done, output = train_dpo(args, tmp_path)  # was: KeyError: 'chosen'
    assert_refused(done, output, "qa.jsonl", "['prompt', 'answer', 'rejected']", "`chosen`, `rejected`",
                   "rename_column")  # fmt: skip
    assert "Loading weights" not in output  # judged on the loaded data, before the model


def test_every_row_truncated_away(toy_models, prefs, tmp_path):
    args = ["--model_name_or_path", toy_models["qwen2"], "--dataset_name", prefs, "--max_length", "2"]
    done, output = train_dpo(args, tmp_path)  # was: the same rule message inside a SafetyError traceback
    assert_refused(done, output, "[data.no_loss_tokens]", "`max_length=2`", "Raise `max_length`")


@pytest.mark.slow  # a process of its own, or a real run
def test_a_shipped_config_on_a_machine_without_the_hub(tmp_path):
    # No Hub: the endpoint is a closed local port, the cache is empty. Was: ConnectionError after minutes of retries.
    env = hub_unreachable(tmp_path)
    done, output = train_dpo(["--config", "configs/trainers/dpo.yaml"], tmp_path, **env)
    dataset, model = "trl-lib/ultrafeedback_binarized", "Qwen/Qwen2.5-0.5B-Instruct"
    assert_refused(done, output, f"`dataset_name={dataset!r}`", "--dataset_name path/to/train.jsonl",
                   f"`model_name_or_path={model!r}`")  # fmt: skip
    assert output.count("so working offline") == 1
    assert "Retrying" not in output


def hub_unreachable(tmp_path: Path) -> dict[str, str | None]:
    """Environment of a machine without the Hub: nothing listens at the endpoint, an empty cache, and no
    `HF_HUB_OFFLINE` (the scripts find out themselves)."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    return {"HF_HUB_OFFLINE": None, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf-home")}


def test_a_bug_still_shows_its_traceback(monkeypatch, capsys):
    """Only a user's mistake becomes a message and exit 2: any other exception leaves `run` as it is (a traceback)."""
    from safe_trainers.scripts import entry, pipeline

    def broken(kind, argv=None):
        raise RuntimeError("a bug")

    monkeypatch.setattr(pipeline, "main", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        entry.run("dpo", [])
    monkeypatch.setattr(pipeline, "main", lambda kind, argv=None: (_ for _ in ()).throw(InputError(text="bad")))
    with pytest.raises(SystemExit) as exit_:
        entry.run("dpo", [])
    assert exit_.value.code == 2 and capsys.readouterr().err == "train_dpo: error: bad\n"


@pytest.mark.distributed
def test_under_accelerate_launch_the_worker_prints_one_message(tmp_path):
    """`accelerate launch -q`: the worker's one message, no traceback. (Without `-q`, accelerate itself raises
    `CalledProcessError` for any failed worker: that traceback is accelerate's, after the message.)"""
    launcher = [*ACCELERATE, "-q", "--num_processes", "1", "--cpu", "--mixed_precision", "no", "--num_machines", "1",
                "--dynamo_backend", "no"]  # fmt: skip
    done, output = train_dpo(["--learning_rate", "-1e-5"], tmp_path, launcher=launcher)
    assert done.returncode == 1, output[-4000:]  # accelerate's own status for a failed worker
    assert "Traceback" not in output, output[-4000:]
    assert output.count("train_dpo: error: `learning_rate=-1e-05` is negative") == 1
