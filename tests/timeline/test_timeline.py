"""`safe-trainers timeline`: the picture and summary of a run, read back from the files it writes (the HTML page's
markers, the PNG, the summary), for the demo's run with its two faults, a run still training, and without matplotlib.
The restarted, preempted and 2-rank runs are drawn in their own tests (tests/restarts, tests/guard), from the runs
those tests launch."""

from __future__ import annotations

import os
import subprocess
import sys

from timeline_utils import PNG_MAGIC, drawn_timeline
from transformers import TrainerCallback

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.timeline.picture import markers_in_html

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def _cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}import sys\nfrom safe_trainers.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], env=ENV, capture_output=True, text=True, timeout=600)


def test_the_demo_runs_timeline_marks_its_two_faults(tmp_path):
    demo = _cli("demo", "--output-dir", str(tmp_path / "demo"), "--no-compare")
    assert demo.returncode == 0, demo.stderr[-3000:]
    run = str(tmp_path / "demo" / "safe")
    drawn = _cli("timeline", run)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    with open(os.path.join(run, "timeline.html"), encoding="utf-8") as f:
        assert markers_in_html(f.read()) == {("skip", 6), ("skip", 9), ("rollback", 9)}
    with open(os.path.join(run, "timeline.png"), "rb") as f:
        assert f.read(8) == PNG_MAGIC
    out = drawn.stdout
    assert "state: finished at step 12" in out and "update skipped x2 (step 6, 9); rollback x1 (step 9)" in out
    assert "goodput " in out and "2 step(s) not applied or rolled back by the guard" in out


def test_a_running_run_is_drawn_from_what_it_wrote_so_far(toy_models, tmp_path):
    out = str(tmp_path / "run")
    trainer = build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", faults=[Fault(step=3, kind="loss")],
                            max_steps=8, save_steps=4, logging_steps=1)  # fmt: skip
    seen = {}

    class DrawAt6(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 6:
                seen["text"], seen["markers"] = drawn_timeline(out, str(tmp_path))

    trainer.add_callback(DrawAt6())
    trainer.train()
    assert seen["markers"] == {("skip", 3)}
    assert "not finished: last record after step 6" in seen["text"]  # the step record is written as steps end
    assert "update skipped x1 (step 3)" in seen["text"] and "goodput " in seen["text"]


def test_without_matplotlib_the_summary_is_printed_with_how_to_get_the_picture(toy_models, tmp_path):
    out = str(tmp_path / "run")
    build_trainer("dpo", toy_models["qwen2"], out, preset="guarded", max_steps=2, save_steps=2).train()
    drawn = _cli("timeline", out, prelude="import sys\nsys.modules['matplotlib'] = None\n")
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert "state: finished at step 2" in drawn.stdout
    assert 'pip install "safe-trainers[timeline]"' in drawn.stderr
    assert not os.path.exists(os.path.join(out, "timeline.png"))


def test_a_directory_that_is_not_a_run_is_refused_with_what_to_pass(tmp_path):
    drawn = _cli("timeline", str(tmp_path))
    assert drawn.returncode == 2 and "is not the `output_dir` of a run" in drawn.stderr
    missing = _cli("timeline", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
