"""The step record: which step a training process was running when it died, kept on disk across restarts.

A SIGKILL, a segfault or a device-side assert ends the process with no chance to say where it was. So the main
process rewrites a tiny file, `output_dir/.safe_trainers_progress.json`, when each optimizer step begins and when it
ends: one host-side write of a few hundred bytes into a file kept open (see [`ProgressWriter`]), with no device
synchronisation. The next process of the run reads it before training and learns whether its predecessor
died inside a step (and which) or between steps (logging, saving, evaluating, fetching data).

Each write also stamps the wall time and the seconds this process has spent inside steps so far, and the history
keeps a [`Span`] of each earlier process (when it began, when it last wrote, the steps it ran): what the run's
timeline (`safe-trainers timeline`) computes the goodput and the restarts' gaps from.

The decisions are pure: [`inherit`] turns the previous record into the new process's [`History`], and [`poison`] names
the step whose batches killed the process `times` times in a row. Only a death *inside* a step counts; the same step
means the same batches, because a resumed run reads exactly the batches of an uninterrupted one and `data` (the
world size, batch sizes, seeds and dataset length) must match. A death while torch compiled inside the step (phase
`"compile"`, see `compile_watch.py`) is not the batches' doing either: the restarted step compiles again, and a
compilation that takes long, or is killed with another rank's hang, twice would otherwise skip a healthy step.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from ..runtime.files import open_no_follow
from .record_format import SPAN_TYPES, Phase, record_problem

PROGRESS_FILE = ".safe_trainers_progress.json"
KEPT_DEATHS = 16
KEPT_SPANS = 64
# The largest step record read (a few hundred bytes; a few KB with many deaths and checkpoints).
RECORD_LIMIT = 2**20



@dataclass(frozen=True)
class Death:
    """An earlier process of the run that died.

    Args:
        attempt (`int`): the process's number in the run (0: the first; each restart or resume adds 1).
        step (`int | None`): the optimizer step it was running; `None` if it died between steps.
    """

    attempt: int
    step: int | None


@dataclass(frozen=True)
class Poisoned:
    """A step whose batches are not trained: they killed `attempts` in a row."""

    step: int
    attempts: tuple[int, ...]


@dataclass(frozen=True)
class Span:
    """What one earlier process of the run did, in wall time.

    Args:
        attempt (`int`): the process's number in the run.
        began (`float`): when it started training (seconds since the epoch).
        ended (`float`): when it last wrote the record (its end, or close to its death).
        first_step (`int`): the step it resumed at (0: from the start).
        last_step (`int`): the last step it finished.
        step_seconds (`float`): the seconds it spent inside optimizer steps.
        finished (`bool`): its `train()` call returned.
    """

    attempt: int
    began: float
    ended: float
    first_step: int
    last_step: int
    step_seconds: float
    finished: bool = False

    @property
    def steps(self) -> int:
        """The steps it finished."""
        return max(self.last_step - self.first_step, 0)

    @property
    def mean_step(self) -> float:
        """Its mean step time (0 with no step)."""
        return self.step_seconds / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class History:
    """What a process inherits from the earlier processes of its run.

    `launch`, `restart`, `stage`, `origin`, `checkpoints` and `result` say whose record it is and what that launch did
    (see `agents.py`): the elastic agents of the launch and the restart count of the process that writes the record,
    which of the script's `train()` calls with this `output_dir` it is, the checkpoint the launch began from, the
    steps of the checkpoints it published (a restarted process trusts only these, never those an earlier run left in
    the same `output_dir`), and what its `train()` returned once it finished. `began` and `first_step`: when the
    writing process started training, and at which step; `spans`: the earlier processes' [`Span`]s.
    """

    attempt: int = 0
    deaths: tuple[Death, ...] = ()
    poisoned: tuple[Poisoned, ...] = ()
    launch: tuple[str, ...] = ()
    restart: int = 0
    stage: int = 1
    origin: str | None = None
    checkpoints: tuple[int, ...] = ()
    result: dict | None = None
    began: float | None = None
    first_step: int = 0
    spans: tuple[Span, ...] = ()

    def poisoned_step(self, step: int) -> Poisoned | None:
        return next((p for p in self.poisoned if p.step == step), None)


@dataclass(frozen=True)
class Progress:
    """The step record as written on disk: where the writing process was, and the run's [`History`] it carried.

    On disk the history's fields sit beside `step`, `phase` and `data` in one flat JSON object (see
    [`ProgressWriter`]); [`from_json`] reads that object back, and records of older versions too.

    Args:
        step (`int`): the step running (`phase="step"`, `"compile"`: torch is compiling inside it) or last finished
            (`"between"`, `"finished"`: training ended).
        phase (`str`): `"step"`, `"compile"`, `"between"` or `"finished"`.
        data (`str`): what makes a step number name the same batches (see [`data_identity`]).
        history ([`History`]): the run's history as the writing process held it (`history.attempt`: its number in
            the run).
        time (`float`): when it was written (seconds since the epoch; 0 in records of older versions).
        step_seconds (`float`): the seconds the writing process had spent inside optimizer steps.
    """

    step: int
    phase: Phase
    data: str
    history: History = History()
    time: float = field(default=0.0, compare=False)
    step_seconds: float = field(default=0.0, compare=False)

    @classmethod
    def from_json(cls, text: str) -> Progress:
        raw = json.loads(text)
        problem = record_problem(raw)
        if problem is not None:
            raise ValueError(f"not a step record: {problem}")
        kept = {k: v for k, v in raw.items() if k in History.__dataclass_fields__}  # a record of an older version
        kept["attempt"] = raw["attempt"]  # as `step`, `phase` and `data`: every version wrote it
        deaths = tuple(Death(**d) for d in kept.pop("deaths", []))
        poisoned = tuple(Poisoned(p["step"], tuple(p["attempts"])) for p in kept.pop("poisoned", []))
        launch = kept.pop("launch", ())
        launch = (launch,) if isinstance(launch, str) else tuple(launch)
        checkpoints = tuple(int(s) for s in kept.pop("checkpoints", ()))
        spans = tuple(Span(**{k: span[k] for k in SPAN_TYPES}) for span in kept.pop("spans", []))  # a newer one's too
        history = History(
            **kept, deaths=deaths, poisoned=poisoned, launch=launch, checkpoints=checkpoints, spans=spans
        )  # fmt: skip
        return cls(
            raw["step"], raw["phase"], raw["data"], history, raw.get("time", 0.0), raw.get("step_seconds", 0.0)
        )  # fmt: skip

    @property
    def finished(self) -> bool:
        """Whether the record's `train()` call finished (it may have died since, finishing again after a restart)."""
        return self.phase == "finished" or self.history.result is not None


def inherit(previous: Progress | None, continuing: bool, data: str, skip_after: int) -> History:
    """The history a new process starts with.

    Args:
        previous: the record the last process of the run left (`None`: none, or unreadable).
        continuing: this process continues the run (a restart, or a resume); a new run starts a new history.
        data: this process's [`data_identity`]; a record made with other data belongs to another run.
        skip_after: a step whose batches killed this many processes in a row is skipped (`0`: never).
    """
    if previous is None or not continuing or previous.data != data:
        return History()
    history = previous.history
    deaths = history.deaths
    if previous.phase != "finished":
        step = previous.step if previous.phase == "step" else None  # died compiling or between steps: no step
        deaths = (deaths + (Death(history.attempt, step),))[-KEPT_DEATHS:]
    poisoned = history.poisoned
    found = poison(deaths, skip_after)
    if found is not None and all(p.step != found.step for p in poisoned):
        poisoned += (found,)
    spans = history.spans
    if history.began is not None:  # the previous process's span (records of older versions have none)
        done = previous.step - 1 if previous.phase in ("step", "compile") else previous.step  # died inside a step
        span = Span(history.attempt, history.began, previous.time, history.first_step, max(done, history.first_step),
                    previous.step_seconds, previous.finished)  # fmt: skip
        spans = (spans + (span,))[-KEPT_SPANS:]
    return replace(
        history, attempt=history.attempt + 1, deaths=deaths, poisoned=poisoned, spans=spans, began=None, first_step=0
    )


def poison(deaths: tuple[Death, ...], times: int) -> Poisoned | None:
    """The step the last `times` deaths all happened in, if they did (`times=0`: never)."""
    last = deaths[-times:] if times > 0 else ()
    if len(last) < max(times, 1) or last[0].step is None or any(d.step != last[0].step for d in last):
        return None
    return Poisoned(last[0].step, tuple(d.attempt for d in last))


def data_identity(args, rows: int | None) -> str:
    """What makes step N read the same batches in two processes: the data-parallel world, the batch sizes, the seeds
    and the dataset's length."""
    return (
        f"world={args.world_size} batch={args.per_device_train_batch_size} "
        f"accumulation={args.gradient_accumulation_steps} seed={args.seed} data_seed={args.data_seed} rows={rows}"
    )


def read_progress(output_dir: str) -> Progress | None:
    """The record in `output_dir`, or `None` if there is none or it cannot be read."""
    try:
        with open(os.path.join(output_dir, PROGRESS_FILE), "rb") as f:
            return Progress.from_json(f.read(RECORD_LIMIT + 1))
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None


class ProgressWriter:
    """Rewrites the step record of one process, in place.

    The file is opened once; each write is one `pwrite` of a few hundred bytes at offset 0 (padded to the longest
    record written, so no byte of an older record is left behind), about a microsecond: a process killed by a signal
    never leaves half a record, as the kernel finishes the write first. Only `step`, `phase`, `time` and
    `step_seconds` change between steps; the rest ([`History`]) is rendered again when it changes (a published
    checkpoint, the end of training).
    """

    def __init__(self, output_dir: str, history: History, data: str):
        os.makedirs(output_dir, exist_ok=True)
        # a link there is refused (`runtime/files.py`)
        self._fd = open_no_follow(os.path.join(output_dir, PROGRESS_FILE))
        os.ftruncate(self._fd, 0)
        self._data = data
        self._size = 0
        self._history = history
        self._head = self._tail = ""  # the record's fixed parts, rendered by the `history` setter
        self.history = history

    @property
    def history(self) -> History:
        return self._history

    @history.setter
    def history(self, history: History) -> None:
        rest = asdict(history)
        rest.pop("attempt")
        self._history = history
        self._head = f'{{"attempt": {history.attempt}, "step": '
        self._tail = f', {json.dumps({"data": self._data, **rest})[1:]}'

    def write(self, step: int, phase: Phase, time: float = 0.0, step_seconds: float = 0.0) -> None:
        stamps = f'", "time": {round(time, 3)}, "step_seconds": {round(step_seconds, 3)}'
        text = f'{self._head}{step}, "phase": "{phase}{stamps}{self._tail}'.encode()
        self._size = max(self._size, len(text))
        os.pwrite(self._fd, text.ljust(self._size), 0)

    def close(self) -> None:
        os.close(self._fd)
