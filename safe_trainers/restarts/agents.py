"""Which launch a training process belongs to, and which of the script's `train()` calls it is running.

torchrun's elastic agent (`torchrun --max-restarts N`, `accelerate launch --max_restarts N`) starts the workers again
after a crash with the same command line and environment, except for what it says about itself:

* `TORCHELASTIC_RESTART_COUNT`: 0 for the first workers of a launch, one more at each restart;
* `TORCHELASTIC_RUN_ID`: the rendezvous run id. Unique with `--standalone` and with torchrun's default single-node
  rendezvous (a random id), but the user's job id with `--rdzv-id`, and `"none"` with `--rdzv-backend static` or an
  explicit `--master-port`: two separate launches may share it;
* `TORCHELASTIC_ERROR_FILE`: `<run dir>/attempt_<restart>/<local rank>/error.json`, where the run dir is a directory
  the agent creates (`mkdtemp`) when it starts, on its host, and keeps for all its restarts: unique to one agent.

So an agent is named by its run id and its run directory on its host ([`agent_identity`]), and a launch by the agents
of its nodes. With `--log-dir /dev/null` the agent makes no run directory (`TORCHELASTIC_ERROR_FILE` is empty); the
agent process itself then names it: the nearest ancestor of the worker that the agent did not start (the first
without `TORCHELASTIC_RESTART_COUNT` in the environment it was started with, [`agent_process`]), one process for all
the restarts of its launch, past any wrapper shell. Neither a parent process id (a wrapper script,
`torchrun --no-python train.sh`, is a new shell at each restart) nor a file time (shared storage stamps files with its
own clock) says which launch wrote something.

A script may call `train()` several times (an SFT, then a DPO stage, in one process): [`TrainCalls`] numbers the calls
made with one `output_dir`, so that a restarted script's first call is recognised as the same stage as before.
"""

from __future__ import annotations

import os
import re
import socket
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
RUN_ID = "TORCHELASTIC_RUN_ID"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
_ATTEMPT_DIR = re.compile(r"^attempt_\d+$")


def restart_count(env: Mapping[str, str]) -> int:
    """How many times the elastic agent has restarted this worker group (0 without one)."""
    value = env.get(RESTART_COUNT, "0")
    return int(value) if value.isdigit() else 0


def agent_run_dir(env: Mapping[str, str]) -> str:
    """The directory the elastic agent keeps for its whole launch (from its error file path), or `""` if unknown."""
    path = env.get(ERROR_FILE, "")
    rank_dir = os.path.dirname(path)
    attempt_dir = os.path.dirname(rank_dir)
    if not path or not _ATTEMPT_DIR.match(os.path.basename(attempt_dir)):
        return ""
    return os.path.dirname(attempt_dir)


def agent_identity(env: Mapping[str, str], host: str | None = None, agent: Callable[[], str] | None = None) -> str:
    """This process's elastic agent: the rendezvous run id, the host and the agent's run directory on it; without the
    directory (`--log-dir /dev/null`, or a launcher other than torchrun's agent), the agent's process
    (`agent`, default [`agent_process`]) in its place, where it can be found."""
    host = host if host is not None else socket.gethostname()
    where = agent_run_dir(env)
    if not where and RESTART_COUNT in env:
        process = (agent or agent_process)()
        where = f"pid:{process}" if process else ""
    return f"{env.get(RUN_ID, '')}@{host}:{where}"


def find_agent(ancestors: Iterable[tuple[int, Mapping[str, str]]]) -> int | None:
    """The agent among a worker's ancestors (`(pid, environment it was started with)`, nearest first): the first the
    agent did not start itself, without `TORCHELASTIC_RESTART_COUNT` (a wrapper shell the agent started has it)."""
    return next((pid for pid, env in ancestors if RESTART_COUNT not in env), None)


def agent_process() -> str:
    """The process id of this worker's elastic agent, read from `/proc` (`""` where there is none to read)."""
    found = find_agent(_proc_ancestors(os.getppid()))
    return str(found) if found is not None else ""


def _proc_ancestors(pid: int) -> Iterator[tuple[int, dict[str, str]]]:
    while pid > 1:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = (item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
                env = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return
        yield pid, env
        pid = parent


def launch_agents(identities: Iterable[str]) -> tuple[str, ...]:
    """The agents of a launch, from every rank's [`agent_identity`] (one per node), sorted and without repeats."""
    return tuple(sorted(set(identities)))


def same_launch(written_by: tuple[str, ...], written_at: int, agents: tuple[str, ...], restart: int) -> bool:
    """Whether a record written by the agents `written_by` at restart count `written_at` is an earlier attempt of
    this launch (`agents`, now at restart count `restart`): they share an agent (a node's agent survives the restarts
    of its launch, even if the rendezvous gives global rank 0 to another node), and it was written before this
    restart. A first attempt (`restart=0`) never continues a record: it is a new launch."""
    return restart > 0 and written_at < restart and bool(set(written_by) & set(agents))


class TrainCalls:
    """Numbers the `train()` calls of this process per `output_dir`: 1 for the first call with a directory, 2 for the
    second call with the same one, and so on. A restarted script makes the same calls in the same order."""

    _calls: Counter[str] = Counter()

    @classmethod
    def next(cls, output_dir: str) -> int:
        key = os.path.realpath(output_dir)
        cls._calls[key] += 1
        return cls._calls[key]

    @classmethod
    def reset(cls) -> None:
        """Forget the calls made so far, as a new process would (for tests that restart a script in-process)."""
        cls._calls.clear()


def will_restart(env: Mapping[str, str]) -> bool:
    """Whether an elastic agent started this process and will restart it: torchrun's agent names itself in the
    worker's environment (`TORCHELASTIC_RESTART_COUNT`, the restarts given so far) and says how many restarts it
    gives in all (`TORCHELASTIC_MAX_RESTARTS`, `--max-restarts`; 0 restarts nothing); its last attempt is not
    restarted either. A plain `python` run or a notebook has neither."""
    most = env.get(MAX_RESTARTS, "")
    return RESTART_COUNT in env and (not most.isdigit() or restart_count(env) < int(most))
