"""Wall-clock marks of a worker run under torchrun's elastic agent, for the restart benches (`restart_cost.py`,
`preemption_cost.py`): the worker appends one JSON line per event (`mark`), the parent launches it with a restart
allowed (`launch_elastic`) and reads the times back (`read_marks`, `at`). Light imports only: a worker takes its
`process_start` time before importing anything heavy. Not a benchmark itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable


def restart_count() -> int:
    """This worker's attempt: how many times the agent restarted it."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def marker(path: str) -> Callable[..., None]:
    """`mark(event, step=None, t=None)`: append the event of this attempt to `path`, at time `t` (default: now),
    flushed at once (the process may be killed right after)."""
    this = restart_count()
    marks = open(path, "a")  # kept open for the life of the worker

    def mark(event: str, step: int | None = None, t: float | None = None) -> None:
        marks.write(json.dumps({"attempt": this, "event": event, "step": step, "t": t or time.time()}) + "\n")
        marks.flush()

    return mark


def launch_elastic(script: str, nproc: int, args: list[str], env: dict[str, str] | None = None) -> None:
    """Run `script --worker *args` on `nproc` local processes under torchrun with one restart; exit with its error
    output if it fails."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        "--max-restarts", "1", os.path.abspath(script), "--worker", *args,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **(env or {}))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])


def read_marks(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def at(marks: list[dict], attempt: int, event: str, step: int | None = None) -> float:
    """The time of `event` (at `step`, if given) in attempt `attempt`."""
    return next(m["t"] for m in marks if m["attempt"] == attempt and m["event"] == event
                and (step is None or m["step"] == step))  # fmt: skip
