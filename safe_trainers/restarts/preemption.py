"""Preemption: on SIGTERM (or another of `preempt_signals`), finish the step, publish a checkpoint, exit resumable.

A cluster ends a job with a signal first (Kubernetes and spot instances: SIGTERM, then SIGKILL after the grace
period; SLURM: SIGTERM before its SIGKILL, and `--signal=USR1@120` ahead of the time limit). With `nan_guard=True` the
trainer takes it as a request to stop at a step boundary:

1. The handler only sets a host flag (the signal may reach every rank, or one).
2. The ranks agree on the step without a host synchronisation: the flag is folded, as a third element, into the
   guard's per-step all-reduce of its fault flags (`StepFlags.end_step`), and each rank reads the agreed bit of step
   `s` back at the end of step `s + 1` (a copy into pinned host memory behind an event, long complete by then; see
   [`AgreedBits`]). Every rank stops at the end of the same step: step `s + 1` for a signal that arrived during step
   `s` (in a single process, the host flag is read directly: step `s` itself).
3. That step saves: the guard verifies the state and publishes it through its staged `_save_checkpoint`, like any
   checkpoint; then `train()` raises [`Preempted`], a `SystemExit` with status [`PREEMPTED_EXIT_CODE`] (75,
   `EX_TEMPFAIL`: "temporary failure, retry"). torchrun's agent restarts the workers on that status when
   `--max-restarts` allows; a re-submitted job resumes with `resume_from_checkpoint=True`. No step is lost.

The handlers are installed when training begins (main thread only), call a Python handler installed before them,
leave an ignored signal ignored, and are put back when training ends. A repeated signal is logged and changes nothing
(the cluster's SIGKILL after its grace period ends a process that cannot stop).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..runtime.collectives import distributed, ranks_with_flag
from ..runtime.events import EventLog, RunEvent
from ..runtime.agreed_values import AgreedValues
from .deadline import Deadline

logger = logging.getLogger("safe_trainers")

PREEMPTED_EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, the job should be retried
READ_LAG = 1  # under several ranks, the agreed bit of step `s` is read at the end of step `s + READ_LAG`


class Preempted(SystemExit):
    """Raised by `train()` after a preemption checkpoint was published: the process exits with status 75.

    Attributes:
        step (`int`): the step of the published checkpoint (the restart continues at `step + 1`).
        signal (`str`): the signal's name.
    """

    def __init__(self, step: int, signal_name: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.signal = signal_name


def parse_signals(names: Sequence[str | int]) -> tuple[signal.Signals, ...]:
    """`preempt_signals` as signals: `"SIGTERM"`, `"TERM"`, `"usr1"` or a number. Raise a `ValueError` otherwise."""
    found = []
    for name in names:
        text = str(name).strip().upper()
        try:
            full = text if text.startswith("SIG") else f"SIG{text}"
            sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[full]
        except (KeyError, ValueError):
            raise ValueError(
                f"`preempt_signals` contains {name!r}, which is not a signal name. Use names such as `\"SIGTERM\"` "
                "or `\"SIGUSR1\"`, or `[]` to leave every signal's handling as it is."
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"`preempt_signals` contains {name!r}: {sig.name} cannot be caught. Use SIGTERM or SIGUSR1."
            )
        found.append(sig)
    return tuple(dict.fromkeys(found))


def stop_step(agreed: Sequence[tuple[int, bool]], lag: int) -> int | None:
    """The step every rank stops at: `lag` steps after the first step whose agreed bit is set (`None`: no request)."""
    first = next((step for step, bit in agreed if bit), None)
    return None if first is None else first + lag


class AgreedBits:
    """A bit of each step (the preemption request, the checkpoint writers' state), agreed across ranks on the device
    and read back one step later.

    Args:
        device (`torch.device`): the device of the guard's flags.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.local = torch.zeros((), dtype=torch.bool, device=self.device)
        self._value = False
        self._agreed = AgreedValues()

    def local_bit(self, value: bool) -> torch.Tensor:
        """This rank's bit for the step closing now (a `fill_` only when it changes: no transfer, no sync)."""
        if value != self._value:
            self.local.fill_(value)
            self._value = value
        return self.local

    def agreed(self, step: int, bit: torch.Tensor) -> None:
        """Keep step `step`'s agreed bit ([`AgreedValues`]: read a step later, no wait on the step just queued)."""
        self._agreed.keep(step, bit)

    def read_through(self, step: int) -> list[tuple[int, bool]]:
        """The agreed bits of the steps up to `step` (their copies are complete by now: the wait is on old work)."""
        return [(at, bool(value)) for at, value in self._agreed.read_through(step)]


class Preemption:
    """Installs the signal handlers and decides the step every rank stops at (which saves; see the module docstring).

    It rides on the guard's per-step all-reduce (a [`FlagRider`], `runtime/ports.py`: the integration layer hands it
    to the guard), and the stopping step's save is the guard's verified one.

    Args:
        events ([`EventLog`]): the run's event log (the `preempt` event).
        signals (`tuple[signal.Signals]`): the signals that mean "preempted".
        deadline ([`Deadline`], *optional*): the job's end time, when the scheduler gives one (`deadline.py`): the
            run asks to stop, as a signal would, at the step after which it could not save in time.
    """

    def __init__(self, events: EventLog, signals: tuple[signal.Signals, ...], deadline: Deadline | None = None):
        self.events = events
        self.signals = signals
        self.deadline = deadline
        self.state: Any = None  # the loop's `TrainerState`, from `on_train_begin`
        self.received: signal.Signals | None = None
        self.requested: str | None = None  # what asked to stop: a signal's name, or `"deadline"`
        self.received_at: float | None = None
        self.received_step: int | None = None
        self.stopping_at: int | None = None
        self.bits: AgreedBits | None = None
        self._previous: dict[signal.Signals, Any] = {}

    # ------------------------------------------------------------------ handlers
    def _handle(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            # A repeat is the same request: under SLURM with torchrun each worker gets the job's SIGTERM and the
            # agent's forwarded copy within milliseconds. The cluster's SIGKILL ends a process that cannot stop.
            logger.warning(f"{sig.name} again: already stopping at a step boundary for {self.received.name}.")
            return
        self.received = sig
        self.request(sig.name, (self.state.global_step if self.state is not None else 0) + 1)
        previous = self._previous.get(sig)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def request(self, reason: str, step: int) -> None:
        """Ask to stop at a step boundary (`reason`: a signal's name or `"deadline"`; `step`: the step it came in)."""
        if self.requested is None:
            self.requested, self.received_at, self.received_step = reason, time.monotonic(), step

    def install(self) -> None:
        self.received = self.requested = self.received_at = self.received_step = self.stopping_at = None
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:  # ignored on purpose by whoever started us
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # ------------------------------------------------------------------ per step (host only)
    def local_bit(self, device: Any) -> torch.Tensor | None:
        """This rank's bit to fold into the guard's all-reduce (`None` in a single process: the flag is read
        directly)."""
        if not (self.signals or self.deadline) or not distributed():
            return None
        if self.bits is None:
            self.bits = AgreedBits(device)
        return self.bits.local_bit(self.requested is not None)

    def agreed(self, step: int, bit: torch.Tensor) -> None:
        if self.bits is not None:
            self.bits.agreed(step, bit)

    def train_began(self, state: Any) -> None:
        """Training starts (`state`: the loop's `TrainerState`, read when a signal comes): install the handlers."""
        self.bits, self.state = None, state
        self.install()
        if self.deadline is not None:  # a request at a step's end rides on the next step's all-reduce
            self.deadline.train_began(READ_LAG + 1 if distributed() else 0, say=state.is_world_process_zero)

    def step_began(self) -> None:
        if self.deadline is not None:
            self.deadline.step_began()

    def step_ended(self, step: int, steps_left: int | None = None) -> bool:
        """Step `step` ended (`steps_left`: before `max_steps`): whether it is the step every rank stops at (it then
        saves, and training stops). A deadline asks to stop only if the run would not end first."""
        deadline = self.deadline
        if deadline is not None and deadline.step_ended() and (steps_left is None or steps_left > deadline.stop_lag):
            self.request("deadline", step)
        if self.bits is not None:
            stop = stop_step(self.bits.read_through(step - READ_LAG), READ_LAG)
        else:
            stop = step if self.requested is not None else None
        if stop is None or self.stopping_at is not None:
            return False
        self.stopping_at = step
        return True

    def save_began(self, step: int) -> None:
        """Step `step`, which just ended, saves a checkpoint: the deadline times it until [`saved`]."""
        if self.deadline is not None:
            self.deadline.save_began(step)

    def saved(self, step: int) -> None:
        """The checkpoint of `step` was published (told by `_after_published`, or by a background save's writer
        thread): the deadline learns how long a save takes."""
        if self.deadline is not None:
            self.deadline.saved(step)

    # ------------------------------------------------------------------ exit
    def exit_if_stopping(self, state: Any, device: Any) -> None:
        """After the stopping step's save: record the event and raise [`Preempted`] (training not finished). `state`:
        the loop's `TrainerState`; `device`: where the ranks' collective runs."""
        if self.stopping_at is None or state.global_step != self.stopping_at:
            return
        self.restore()
        name = self.requested if self.requested is not None else "a signal on another rank"
        received = torch.tensor([self.requested is not None], device=device)
        ranks = ranks_with_flag(received)[0]  # every rank stops at this step: one collective, once
        detail = {"signal": name, "received_step": self.received_step, "checkpoint_step": self.stopping_at}
        if self.deadline is not None:
            detail.update(self.deadline.report())
        if self.received_at is not None:
            detail["seconds_since_signal"] = round(time.monotonic() - self.received_at, 3)
        self.events.add(RunEvent(self.stopping_at, "preempt", [], ranks, detail))
        if state.is_world_process_zero:
            logger.warning(
                f"Preempted ({name}): checkpoint-{self.stopping_at} is published; exiting with status "
                f"{PREEMPTED_EXIT_CODE} (preempted, resumable). A restart by the elastic agent, or "
                "`train(resume_from_checkpoint=True)`, continues at step "
                f"{self.stopping_at + 1} with the same batches."
            )
        raise Preempted(self.stopping_at, name)


def refuse_jit_checkpoint(args: Any, nan_guard: bool) -> None:
    """Refuse transformers' `enable_jit_checkpoint` under the guard, before its SIGTERM handler is installed."""
    if nan_guard and getattr(args, "enable_jit_checkpoint", False):
        raise ValueError(
            "`enable_jit_checkpoint=True` saves a checkpoint mid-step on each rank after its own timer; under the NaN "
            "guard a save is verified and collective, so ranks that save at different points wait on each other "
            "forever, and a signal to one rank saves on that rank only. safe_trainers handles preemption itself: "
            "with `preempt_signals` (default `[\"SIGTERM\", \"SIGUSR1\"]`) every rank finishes its step, a verified "
            "checkpoint is published and the process exits with status 75. Remove `enable_jit_checkpoint=True`, or "
            "set `nan_guard=False` to use transformers' JIT checkpointing instead."
        )


__all__ = [
    "PREEMPTED_EXIT_CODE", "AgreedBits", "Preempted", "Preemption", "parse_signals", "refuse_jit_checkpoint",
    "stop_step",
]  # fmt: skip
