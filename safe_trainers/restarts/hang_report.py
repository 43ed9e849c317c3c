"""What a hang does: the stacks are always written; the process exits only where something will restart it.

A step past the hang bound (see `watchdog.py`) makes its rank append the Python stacks of all its threads to
`output_dir/hang-stacks-rank<r>.txt`. Then [`hang_exits`] decides, from `hang_action` and the launch:

* under torchrun's elastic agent with restarts left to give (`--max-restarts` above the restarts so far), `"auto"`
  ends the process with `os._exit(HUNG_EXIT_CODE)` (a hung thread cannot be unwound): the agent restarts the workers
  from the newest healthy checkpoint;
* with no agent (a plain `python` run, a notebook, a job whose scheduler is not told to restart it), `--max-restarts 0`
  or the agent's last attempt, `"auto"` reports the hang (an error in the log, a `hang` event) and lets the process
  go on: ending it would kill the user's kernel and restart nothing. A step that was merely slow then finishes;
* `"exit"` always exits (a scheduler that restarts on status 124, as a Kubernetes `podFailurePolicy` can);
  `"report"` never does.
"""

from __future__ import annotations

import faulthandler
import logging
import os
from collections.abc import Mapping

from ..runtime.files import open_append_no_follow
from .agents import will_restart

logger = logging.getLogger("safe_trainers")

HUNG_EXIT_CODE = 124  # as `timeout(1)`: the command ran past its time limit


def hang_exits(action: str, env: Mapping[str, str]) -> bool:
    """Whether a hang ends the process: `hang_action="exit"`, or `"auto"` where the elastic agent will restart it.

    Args:
        action: `hang_action`: `"auto"`, `"exit"` or `"report"`.
        env: the process's environment (torchrun's agent describes itself there, see `agents.py`).
    """
    return action == "exit" or (action == "auto" and will_restart(env))


def hang_plan_line(exits: bool, action: str, ceiling: float, factor: float) -> str:
    """The start-up line that announces the watchdog and what a hang will do."""
    bound = f"bound `hang_timeout={ceiling:g}` s, then `hang_timeout_factor={factor:g}` x the slowest step"
    if exits:
        what = f"writes every thread's stacks and exits with status {HUNG_EXIT_CODE} for a restart"
    else:
        what = "writes every thread's stacks and reports it (a `hang` event); the process is not ended"
    why = {True: "torchrun's elastic agent will restart the workers", False: "nothing will restart this process"}
    why = why[exits] if action == "auto" else "as asked"
    return (
        f"Hang watchdog on ({bound}; compilation and checkpoint loading are not timed): a hung step {what} "
        f"(`hang_action={action!r}`: {why}). Set `hang_action=\"exit\"` or `\"report\"` to choose, or "
        "`hang_timeout=0` to turn the watchdog off."
    )


def stacks_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, f"hang-stacks-rank{rank}.txt")


def write_stacks(path: str, head: str) -> None:
    """Append `head` and the stacks of every thread of this process to `path`."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open_append_no_follow(path) as f:  # a link there is refused (`runtime/files.py`)
        f.write(head)
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
        f.write("\n")


def hang_message(rank: int, step: int, elapsed: float, bound: float, path: str, exits: bool) -> str:
    """The error logged for a hang: where the stacks are, what happens now, and the settings that change it."""
    said = (
        f"Rank {rank}: step {step} has run {elapsed:.0f} s, past the hang bound of {bound:.0f} s (compilation and "
        f"checkpoint loading not counted); the stacks of every thread are in {path}."
    )
    if exits:
        return (
            f"{said} Exiting with status {HUNG_EXIT_CODE} so the elastic agent restarts the workers from the newest "
            "checkpoint. Raise `hang_timeout` (or set it to 0) if steps this long are expected, or set "
            "`hang_action=\"report\"` to keep the process."
        )
    return (
        f"{said} The process goes on (nothing will restart it; `hang_action=\"exit\"` ends it with status "
        f"{HUNG_EXIT_CODE} instead); if the step finishes, training continues. Raise `hang_timeout` (or set it to 0) "
        "if steps this long are expected."
    )


def exit_hung() -> None:
    """End the process at once (a hung thread cannot be unwound), the log flushed first."""
    logging.shutdown()
    os._exit(HUNG_EXIT_CODE)


__all__ = [
    "HUNG_EXIT_CODE", "exit_hung", "hang_exits", "hang_message", "hang_plan_line", "stacks_path",
    "write_stacks",
]  # fmt: skip
