"""The hang watchdog never kills a run that is working (issue 28, section 3).

A recompile spent longer than the hang bound in inductor's build and the watchdog ended the process with status 124;
in a plain `python` run or a notebook, where nothing restarts it, `os._exit` killed the user's kernel; and a step
killed twice while it compiled would have been skipped as poisoned. Compilation now stops the step's clock, a hang
exits only where the elastic agent restarts the process (or `hang_action="exit"`), and a death while compiling
never counts for `skip_step_after_crashes`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
from test_crash_restarts import REPO, WORKER, launch_restarting
from transformers import AutoModelForCausalLM, TrainerCallback

from safe_trainers.configs import config_class
from safe_trainers.guard import read_events
from safe_trainers.restarts.compile_peers import RECHECK, PeerCompiles
from safe_trainers.restarts.hang_report import HUNG_EXIT_CODE, hang_exits, stacks_path
from safe_trainers.restarts.progress import PROGRESS_FILE, History, ProgressWriter, inherit, read_progress
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.toy import save_toy_model
from safe_trainers.trainers import trainer_class

AGENT = {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "2"}


@pytest.fixture
def no_agent(monkeypatch):
    """A plain process: no torchrun agent in the environment, whatever the test runner was started under."""
    for name in (*AGENT, "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------------------------------- pure decisions
def test_a_hang_exits_only_where_something_restarts_the_process_or_when_asked():
    assert hang_exits("auto", AGENT)  # torchrun with restarts to give: exit 124, the agent restarts
    assert not hang_exits("auto", {})  # a plain python run, a notebook
    assert not hang_exits("auto", {**AGENT, "TORCHELASTIC_MAX_RESTARTS": "0"})  # the agent restarts nothing
    # The last attempt the agent gives (`--max-restarts 2`, restarted twice already): the agent restarts nothing
    # more, so an exit would end the job where the step might still finish.
    assert hang_exits("auto", {**AGENT, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not hang_exits("auto", {**AGENT, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert hang_exits("exit", {}) and not hang_exits("report", AGENT)
    with pytest.raises(ValueError, match=r"`hang_action` must be one of \['auto', 'exit', 'report'\], got 'kill'"):
        config_class("sft")(output_dir="unused", hang_action="kill")


def test_a_step_that_died_while_compiling_twice_is_not_poisoned(tmp_path):
    # Two processes died in step 6 while torch compiled it (a compile killed with another rank's hang, an OOM kill in
    # inductor's build): the step's batches did not kill them, so they are never skipped. Two deaths in the step
    # itself still poison it.
    data = "world=1"
    for phase, poisoned in (("compile", ()), ("step", (6,))):
        run = tmp_path / phase
        history = History()
        for attempt in range(2):
            writer = ProgressWriter(str(run), history, data)
            writer.write(6, phase)  # the process dies here
            writer.close()
            history = inherit(read_progress(str(run)), continuing=True, data=data, skip_after=2)
            assert history.attempt == attempt + 1
        assert tuple(p.step for p in history.poisoned) == poisoned, phase
        assert [d.step for d in history.deaths] == ([None, None] if phase == "compile" else [6, 6])


def test_a_rank_past_its_bound_waits_while_another_rank_compiles_and_as_long_again():
    store = torch.distributed.HashStore()
    compiling, waiting = PeerCompiles(store, 0, 2), PeerCompiles(store, 1, 2)
    assert waiting.excused(5, over=1.0) == 0.0  # nobody compiles: a hang
    compiling.began()
    assert waiting.excused(5, over=2.0) == 2.0 + RECHECK  # asked again later
    assert waiting.excused(5, over=3.0) == 2.0 + RECHECK
    compiling.ended(5, 30.0)
    assert waiting.excused(5, over=8.0) == 30.0  # as long again as the other rank compiled in the step
    assert waiting.excused(6, over=1.0) == 0.0 and compiling.excused(5, over=1.0) == 0.0


# ---------------------------------------------------------------------------------------------------- real runs
def test_a_step_that_compiles_past_the_bound_finishes(toy_models, tmp_path, no_agent):
    # The model is compiled with a backend that takes 6 s, past the 4 s bound: at the first step (its first compile)
    # and at the first recompile on a new sequence length after two steps were timed. Before, the watchdog took the
    # compile for a hang and ended the process with status 124 (here: pytest itself). Now the compile stops the
    # step's clock: the run finishes, with no stacks and no `hang` event, and the step record said "compile" while
    # the compiler ran.
    compiles: list[tuple[int, str | None]] = []
    holder: dict = {}

    def slow_backend(graph_module, example_inputs):
        trainer = holder.get("trainer")
        step = trainer.state.global_step + 1 if trainer is not None else 0
        record = read_progress(trainer.args.output_dir) if trainer is not None else None
        if not compiles or (step >= 3 and all(s < 3 for s, _ in compiles)):
            time.sleep(6)  # a long inductor build, on purpose
        compiles.append((step, record.phase if record is not None else None))
        return graph_module.forward

    model = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"])
    model.compile(backend=slow_backend)
    trainer = build_trainer(
        "sft", model, tmp_path / "out", preset="guarded", max_steps=6, save_strategy="no", bf16=False,
        hang_timeout=4,
    )  # fmt: skip
    holder["trainer"] = trainer
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # each new sequence length compiles again
        trainer.train()
    out = trainer.args.output_dir
    assert trainer.state.global_step == 6
    assert any(step >= 3 for step, _ in compiles), compiles  # a recompile after the bound was learned
    assert all(phase == "compile" for step, phase in compiles if step >= 1), compiles
    assert not os.path.exists(stacks_path(out, 0))
    assert [e for e in read_events(out) if e["kind"] == "hang"] == []
    assert read_progress(out).phase == "finished"
    from torch._dynamo.callback import callback_handler

    assert trainer.safe_run.compile_watch._began not in callback_handler.start_callbacks  # removed when `train()` ended


class ResetsDynamo(TrainerCallback):
    """Calls `torch._dynamo.reset()` at the end of step `at` (a user freeing compiled graphs, e.g. after an
    evaluation): it clears every compile callback, and every graph compiles again."""

    def __init__(self, at: int, marks: dict):
        self.at, self.marks = at, marks

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            torch._dynamo.reset()
            self.marks["reset"] = True


def test_a_compile_after_torch_dynamo_reset_is_not_timed(toy_models, tmp_path, no_agent):
    # `torch._dynamo.reset()` in the middle of `train()` removed the compile watch's callbacks; the recompile that
    # follows (6 s, past the 3 s bound) was timed as a hang (stacks written, a `hang` event, exit 124 under the
    # agent). The watch is registered again at the next step.
    marks: dict = {}

    def slow_backend(graph_module, example_inputs):
        if marks.pop("reset", False):  # the first compile after the reset
            marks["slow"] = True
            time.sleep(6)
        return graph_module.forward

    model = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"])
    model.compile(backend=slow_backend, dynamic=False)
    trainer = build_trainer(
        "sft", model, tmp_path / "out", preset="guarded", max_steps=4, save_strategy="no", bf16=False,
        hang_timeout=3,
    )  # fmt: skip
    trainer.add_callback(ResetsDynamo(2, marks))
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        trainer.train()
    out = trainer.args.output_dir
    assert marks.get("slow") and trainer.state.global_step == 4
    assert [e for e in read_events(out) if e["kind"] == "hang"] == []
    assert not os.path.exists(stacks_path(out, 0))


@pytest.mark.distributed
def test_a_rank_that_waits_for_another_ranks_compile_is_not_hung(tmp_path):
    # Rank 0's first compile takes 20 s (a long inductor build, or a recompile on a sequence length only it was
    # given); rank 1 compiled at once and waits for rank 0 in the step's all-reduce. Rank 0's clock stopped while it
    # compiled, rank 1's ran: past the 10 s bound it wrote its stacks and exited with status 124, and the agent
    # restarted both. Now a rank's watchdog knows that another rank compiles, and for how long it did.
    results, streams = launch_restarting(
        tmp_path, 2, 1, "--slow_compile", "20:0:0", "--hang_timeout", "10", "--max_steps", "3", "--save_steps", "3"
    )
    run = tmp_path / "out" / "run"
    assert not (run / "hang-stacks-rank1.txt").exists(), (run / "hang-stacks-rank1.txt").read_text()[-3000:]
    assert [e for e in read_events(str(run)) if e["kind"] == "hang"] == []
    assert [(r["attempt"], r["global_step"]) for r in results] == [(0, 3), (0, 3)]


class SlowStepSFTTrainer(trainer_class("sft")):
    """Sleeps `sleep` seconds in the first micro-batch of step `slow_step` (a hang that ends by itself)."""

    slow_step, sleep = 3, 7.0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and self.state.global_step + 1 == self.slow_step and self.sleep:
            sleep, self.sleep = self.sleep, 0.0
            time.sleep(sleep)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_a_hang_without_an_agent_is_reported_and_the_process_goes_on(toy_models, tmp_path, no_agent, caplog):
    # No elastic agent: `os._exit(124)` killed the user's process (a notebook's kernel) and nothing restarted it. Now
    # the stacks are written, an error is logged and a `hang` event recorded, and the run goes on when the step does.
    trainer = build_trainer(
        "sft", toy_models["qwen2"], tmp_path / "out", preset="guarded", max_steps=5, save_strategy="no", bf16=False,
        hang_timeout=3, trainer_cls=SlowStepSFTTrainer,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="safe_trainers"):
        trainer.train()
    out = trainer.args.output_dir
    assert trainer.state.global_step == 5
    assert "reports it (a `hang` event); the process is not ended" in caplog.text  # the start-up line says which
    assert "nothing will restart this process" in caplog.text
    stacks = open(stacks_path(out, 0)).read()
    assert stacks.count("step 3 has run") == 1 and "in compute_loss" in stacks
    hangs = [e for e in read_events(out) if e["kind"] == "hang"]
    assert [(e["step"], e["exited"], e["ranks"]) for e in hangs] == [(3, False, [0])]
    assert "The process goes on" in caplog.text
    assert trainer.safe_run.watchdog.timed == 3  # steps 2, 4, 5: the hung step is not learned from


@pytest.mark.slow  # a process of its own, or a real run
def test_a_hang_with_the_exit_asked_for_ends_the_process_with_status_124(tmp_path):
    # `hang_action="exit"` in a plain process (a scheduler that restarts on status 124): stacks, then exit 124.
    model = save_toy_model(str(tmp_path / "model"), "qwen2")
    out = tmp_path / "out"
    cmd = [
        sys.executable, WORKER, "--model", model, "--out", str(out), "--hang", "3:0", "--hang_timeout", "3",
        "--hang_action", "exit", "--max_steps", "5",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert done.returncode == HUNG_EXIT_CODE, (done.stdout + done.stderr)[-4000:]
    run = out / "run"
    assert "step 3 has run" in (run / "hang-stacks-rank0.txt").read_text()
    assert "Exiting with status 124" in done.stderr
    assert [(e["step"], e["kind"], e["exited"]) for e in read_events(str(run))] == [(3, "hang", True)]
    record = json.loads((run / PROGRESS_FILE).read_text())
    assert (record["step"], record["phase"]) == (3, "step")  # a hang is a death in the step, as before
    assert not (out / "result-rank0.json").exists()
