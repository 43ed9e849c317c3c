"""TRL's own example scripts, with only their import lines changed, on the tiny local models and data.

The scripts are read from the installed TRL package at test time (`trl/scripts/{sft,reward,dpo,kto,grpo,rloo}.py`,
nothing is copied into this repository). Each `from trl import ...` line, and each `from trl.<module> import ...`
line that only names public `trl` names, becomes `from safe_trainers import ...`; the rest of the script is TRL's. The
rewritten script must train, save the model and write `safety_report.json`; the unmodified script is the control (it
must train too, and write no report).

The twelve runs are processes of their own, started by a module fixture (see `DRIVER`), up to four at a time.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from safe_trainers.kinds import KINDS, TRAINER_KINDS
from safe_trainers.testing.toy import dataset_for, save_toy_model


ROOT = Path(__file__).resolve().parents[2]
TRL_SCRIPTS = Path(importlib.util.find_spec("trl").submodule_search_locations[0]) / "scripts"
ARGS = [
    "--max_steps", "2",
    "--per_device_train_batch_size", "2",
    "--learning_rate", "1e-3",
    "--logging_steps", "1",
    "--save_strategy", "steps",
    "--save_steps", "2",
    "--report_to", "none",
    "--use_cpu", "true",
    "--bf16", "false",
    "--disable_tqdm", "true",
    "--gradient_checkpointing", "false",
]  # fmt: skip
ONLINE_ARGS = ["--num_generations", "2", "--max_completion_length", "8", "--reward_funcs", "script_rewards.rank"]
# The GRPO and RLOO scripts import `--reward_funcs` dotted paths from the working directory.
REWARDS = """
def rank(completions, **kwargs):
    return [float(i % 4) for i in range(len(completions))]  # differs inside every group: a gradient at every step
"""


def public_trl_names() -> set[str]:
    """`trl.__all__` without TRL's submodules: the names `from trl import *` brings."""
    import trl

    return {name for name in trl.__all__ if importlib.util.find_spec(f"trl.{name}") is None}


def rewrite_trl_imports(source: str, public: set[str]) -> tuple[str, list[str]]:
    """`source` with every import of public `trl` names taken from `safe_trainers` instead; also the rewritten lines.

    `from trl import A, B` and `from trl.trainer import A` (all names public) become `from safe_trainers import A, B`
    (aliases kept, indentation kept, a parenthesised import spanning lines becomes one line); imports of anything else
    (`from trl.rewards import accuracy_reward`, `import trl`) are left alone.
    """
    lines = source.splitlines(keepends=True)
    nodes = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and (node.module == "trl" or (node.module or "").startswith("trl."))
        and all(alias.name in public for alias in node.names)
    ]
    rewritten = []
    for node in sorted(nodes, key=lambda n: n.lineno, reverse=True):
        first = lines[node.lineno - 1]
        indent = first[: len(first) - len(first.lstrip())]
        names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
        line = f"{indent}from safe_trainers import {names}\n"
        lines[node.lineno - 1 : node.end_lineno] = [line]
        rewritten.append(line.strip())
    return "".join(lines), rewritten[::-1]


def test_rewrite_trl_imports():
    source = textwrap.dedent(
        """
        from trl import ScriptArguments
        def main():
            from trl import (
                DPOTrainer,
                get_dataset as load,
            )
            from trl.trainer import SFTConfig
            from trl.rewards import accuracy_reward
            import trl
        """
    )
    out, lines = rewrite_trl_imports(source, public_trl_names())
    assert lines == [
        "from safe_trainers import ScriptArguments",
        "from safe_trainers import DPOTrainer, get_dataset as load",
        "from safe_trainers import SFTConfig",
    ]
    assert "    from safe_trainers import DPOTrainer, get_dataset as load\n" in out
    assert "from trl.rewards import accuracy_reward" in out and "import trl\n" in out
    ast.parse(out)


# Runs every script as `python script.py ...` would, in a process of its own, but forked from one that has already
# imported torch, transformers, TRL and safe_trainers (none of which runs any torch op at import): twelve runs pay the
# five-second import once. The children are independent, so nothing one run sets leaks into another.
DRIVER = """
import json, os, runpy, sys, traceback
import torch, transformers, datasets, peft, trl, safe_trainers
for name in ("SFTTrainer", "RewardTrainer", "DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer", "TrlParser"):
    getattr(trl, name)
jobs, width, results, running = json.loads(sys.argv[1]), int(sys.argv[2]), {}, {}
def run(script, argv, log):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [script, *argv]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
for key, (script, argv, log) in jobs.items():
    while len(running) >= width:
        pid, status = os.wait()
        results[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    pid = os.fork()
    if pid == 0:
        run(script, argv, log)
    running[pid] = key
while running:
    pid, status = os.wait()
    results[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps(results))
"""


@dataclass
class ScriptRun:
    returncode: int
    output: str
    out: Path
    model: Path


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> dict[tuple[str, str], ScriptRun]:
    """Run every script twice, rewritten (`"safe"`) and as shipped (`"trl"`); keyed by `(kind, variant)`."""
    root = tmp_path_factory.mktemp("trl-scripts")
    (root / "script_rewards.py").write_text(REWARDS)
    public = public_trl_names()
    jobs, dirs = {}, {}
    for kind in TRAINER_KINDS:
        row = KINDS[kind]
        model = root / f"model-{row.model_task}"
        if not model.exists():
            save_toy_model(str(model), task=row.model_task)
        data = root / f"data-{kind}"
        # a local folder of data files, which `load_dataset` reads in every supported `datasets` release (4.x infers
        # the JSON builder from a `save_to_disk` folder's metadata files and cannot read it)
        data.mkdir()
        dataset_for(kind, 16).to_parquet(str(data / "train.parquet"))
        source = (TRL_SCRIPTS / f"{kind}.py").read_text()
        rewritten, _ = rewrite_trl_imports(source, public)
        for variant, text in (("safe", rewritten), ("trl", source)):
            script = root / f"{kind}_{variant}.py"
            script.write_text(text)
            out = root / f"out-{kind}-{variant}"
            argv = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out), *ARGS]
            if row.online:
                argv += ONLINE_ARGS
            key = f"{kind}-{variant}"
            jobs[key] = (str(script), argv, str(root / f"{key}.log"))
            dirs[key] = (out, model)

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    width = str(max(1, min(4, os.cpu_count() or 1)))
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(jobs), width], cwd=root, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    runs = {}
    for key, code in codes.items():
        kind, variant = key.rsplit("-", 1)
        runs[(kind, variant)] = ScriptRun(code, Path(jobs[key][2]).read_text(), *dirs[key])
    return runs


def check_trained_and_saved(run: ScriptRun) -> None:
    assert run.returncode == 0, run.output[-5000:]
    state = json.loads((run.out / "checkpoint-2" / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert state["global_step"] == 2 and len(losses) == 2
    assert all(torch.isfinite(torch.tensor(losses)))
    before, after = load_file(str(run.model / "model.safetensors")), load_file(str(run.out / "model.safetensors"))
    assert set(after) == set(before)
    assert any(not torch.equal(after[k], before[k]) for k in before), "the saved weights are the initial ones"


@pytest.mark.slow  # a process of its own, or a real run
@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_trl_script_with_safe_trainers_imports(kind, script_runs):
    run = script_runs[(kind, "safe")]
    check_trained_and_saved(run)
    report = json.loads((run.out / "safety_report.json").read_text())
    assert report["trainer"] == kind and report["mode"] == "fix"
    assert (run.out / "checkpoint-2" / "nan_guard_state.json").is_file()  # the NaN guard ran


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_trl_script_unmodified_control(kind, script_runs):
    run = script_runs[(kind, "trl")]
    check_trained_and_saved(run)
    assert not (run.out / "safety_report.json").exists()
    assert not (run.out / "checkpoint-2" / "nan_guard_state.json").exists()


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_only_import_lines_change(kind):
    source = (TRL_SCRIPTS / f"{kind}.py").read_text()
    rewritten, lines = rewrite_trl_imports(source, public_trl_names())
    assert lines and "from trl import" not in rewritten
    old, new = source.splitlines(), rewritten.splitlines()
    trl_imports = {
        line
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trl"
        for line in range(node.lineno - 1, node.end_lineno)
    }
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag != "equal":
            assert set(range(i1, i2)) <= trl_imports, old[i1:i2]
            assert all(line.strip().startswith("from safe_trainers import ") for line in new[j1:j2]), new[j1:j2]
