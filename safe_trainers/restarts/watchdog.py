"""Hangs: a step that takes far longer than the run's steps ends the process, with its stacks, so it is restarted.

A weight sync that never returns, a generation that all-gathers ZeRO-3 weights at every token, a rank stuck in a
collective: without a watchdog the run waits out the collective timeout (`ddp_timeout`, 30 minutes by default) and
dies without saying where each rank was. Here each rank runs a [`HangWatchdog`] thread that the training loop feeds
with host-side heartbeats from its callbacks (`time.monotonic()` when a step begins and when the guard has inspected
it; no device synchronisation). The watchdog is armed only inside a step (from `on_step_begin` to the end of the
guard's inspection of the step, its collectives included; a snapshot's copy, a rollback's restore, the diagnosis
replay of a skipped step and an abort's checkpoint are not timed); evaluation, saving and logging between steps may
take as long as they take, but the guard's verification before a save or an evaluation, a collective every rank
must reach, is timed against the same bound ([`HangWatchdog.armed`]). GRPO/RLOO generation happens inside a step and
is timed with it.

The bound is a pure function of the steps timed so far in this `train()` call ([`hang_bound`]; a second call on the
same trainer, another stage with other settings, learns its own): before `LEARN_AFTER` steps were timed (the first
step of each call, with its compilation and warm-up, is not; GRPO/RLOO, which generate only every few steps,
time a whole generation cycle, [`generation_period`]), the ceiling `hang_timeout`; then
`hang_timeout_factor` times the slowest step, at least `HANG_FLOOR` seconds, never above the ceiling. With the
defaults a run of one-second steps is taken for hung after 120 s.

Time is progress's, not the wall clock's: while torch compiles (its compile hooks, see `compile_watch.py`; the
forward, the lazily compiled backward, autotuning, cudagraph recording) the step's clock stops, as it does for the
guard's known long phases ([`HangWatchdog.paused`]); checkpoint loading happens before training begins or in a
rollback, neither timed. A step that compiled is given, once its compilation ended, as long again on top of the bound:
the other ranks compile the same graphs, and a rank that finished first waits for the slowest in the step's
collective; a rank past its bound waits as long for the other ranks' compilations (see `compile_peers.py`).

A step past the bound makes the rank write the Python stacks of all its threads to
`output_dir/hang-stacks-rank<r>.txt` (appended, one block per hang), log an error and record a `hang` event (another
rank's reaches the main process's event log on the guard's all-reduce, if its process goes on: `hang_relay.py`); then,
under torchrun's elastic agent with restarts to give (or with `hang_action="exit"`), it ends with
`os._exit(HUNG_EXIT_CODE)`; elsewhere the process goes on (see `hang_report.py`). The other ranks, blocked in a
collective that waits for it, pass the bound too and do the same; the agent then restarts the workers, which resume
from the newest healthy checkpoint. The step record still names the step, so a hang counts like a crash for
`skip_step_after_crashes`: a step that hangs twice in a row is skipped on the next attempt (a death while compiling
never counts, see `progress.py`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .compile_peers import NO_PEERS, peer_compiles
from .hang_report import HUNG_EXIT_CODE, exit_hung, hang_message, hang_plan_line, stacks_path, write_stacks

logger = logging.getLogger("safe_trainers")

HANG_FLOOR = 120.0  # seconds: the learned bound is never below this
LEARN_AFTER = 2  # steps timed (after each process's first) before the bound is learned
POLL = 0.5  # seconds between the watchdog thread's looks at the clock


def hang_bound(
    slowest: float | None,
    timed: int,
    ceiling: float,
    factor: float,
    floor: float = HANG_FLOOR,
    learn_after: int = LEARN_AFTER,
) -> float:
    """The seconds a step may take before it counts as hung.

    Args:
        slowest: the slowest step timed so far (`None`: none yet).
        timed: how many steps were timed.
        ceiling: `hang_timeout`, the bound until the steps were learned and the most it ever is.
        factor: `hang_timeout_factor`.
        floor: the least the learned bound is.
        learn_after: the steps to time before the bound is learned (at least one whole generation cycle of
            GRPO/RLOO, see `generation_period`).
    """
    if slowest is None or timed < learn_after:
        return ceiling
    return min(ceiling, max(floor, factor * slowest))


def generation_period(args: Any) -> int:
    """Every how many optimizer steps GRPO/RLOO generate (1 for the other trainers): they generate once every
    `steps_per_generation * num_iterations` micro-batches and train on the buffered rollouts in between, so the
    steps of a cycle differ in time by the whole generation, and the bound must be learned from a generating step."""
    micro = (getattr(args, "steps_per_generation", None) or 0) * (getattr(args, "num_iterations", None) or 1)
    accumulation = max(1, getattr(args, "gradient_accumulation_steps", 1) or 1)
    return max(1, -(-micro // accumulation))


class HangWatchdog:
    """Times each step on the host and reports, or ends the process, when one passes the bound (see the module
    docstring).

    Args:
        output_dir (`str`): where the stacks are written.
        rank (`int`): this process's global rank.
        ceiling (`float`): `hang_timeout` in seconds.
        factor (`float`): `hang_timeout_factor`.
        attempt (`int`): the elastic agent's restart count, written with the stacks.
        learn_after (`int`): the steps timed before the bound is learned (`LEARN_AFTER`, or a generation cycle).
        clock (`Callable[[], float]`): the monotonic clock (`time.monotonic`).
        exits (`bool`): a hang ends the process (`hang_action`, see `hang_report.hang_exits`); otherwise it is
            reported and the process goes on.
        action (`str`): `hang_action`, named in the start-up line.
        on_hang (`Callable[[int, dict], Any]`, *optional*): called with the step and the hang's detail (the `hang`
            event), in the watchdog's thread, before the process exits.
    """

    def __init__(
        self,
        output_dir: str,
        rank: int,
        ceiling: float,
        factor: float,
        attempt: int = 0,
        clock: Callable[[], float] = time.monotonic,
        learn_after: int = LEARN_AFTER,
        exits: bool = True,
        action: str = "auto",
        on_hang: Callable[[int, dict], Any] | None = None,
    ):
        self.output_dir, self.rank, self.attempt, self.clock = output_dir, rank, attempt, clock
        self.ceiling, self.factor, self.learn_after = ceiling, factor, max(LEARN_AFTER, learn_after)
        self.exits, self.action, self.on_hang = exits, action, on_hang
        self.slowest: float | None = None
        self.timed = 0
        self._step = 0
        self._began: float | None = None  # set while a step runs and is timed (read by the thread: one attribute)
        self._lock = threading.Lock()  # `hold`/`release` may come from another thread (a compilation's hooks)
        self._holds = 0  # paused blocks and compilations running now
        self._held: float | None = None  # the step's `_began` while held
        self._held_at = 0.0
        self._compile_at: float | None = None
        self._grace = 0.0  # seconds added to the bound in this step: its compilations' time
        self.peers = NO_PEERS  # the other ranks' compilations (several ranks)
        self._reported = False  # this step's hang was reported (the process went on)
        self._first = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ heartbeats (the training loop)
    def train_began(self, main: bool) -> None:
        """Training starts: the thread starts (and `main`, the main process, says what a hang will do)."""
        self.peers = peer_compiles(self.rank)
        self.start()
        if main:  # shown by default, as the resume lines are: what a hang will do here
            logger.warning(hang_plan_line(self.exits, self.action, self.ceiling, self.factor))

    def step_began(self, step: int) -> None:
        """Optimizer step `step` begins: its clock starts."""
        self._step = step
        self._restart_clock(self.clock())

    def step_ended(self) -> None:
        """The step ended: its time is learned (after the first, warm-up step)."""
        with self._lock:
            began, self._began, self._held = self._began, None, None
        if began is None:
            return
        took = self.clock() - began
        if self._first or self._reported:  # warm-up (allocator, communicators), or a step reported as hung
            self._first = False
            return
        self.slowest = took if self.slowest is None else max(self.slowest, took)
        self.timed += 1

    def _restart_clock(self, now: float | None) -> None:
        with self._lock:
            self._began, self._held, self._grace, self._reported = now, None, 0.0, False
            if self._holds:  # a compilation in another thread goes on: the new clock starts held
                self._held, self._began = now, None

    # ------------------------------------------------------------------ known long phases: not timed
    def hold(self) -> None:
        """Stop the step's clock (nested holds count: it goes on when the last is released)."""
        with self._lock:
            self._holds += 1
            if self._holds == 1:
                self._held, self._began = self._began, None
                self._held_at = self.clock()

    def release(self) -> None:
        """Let the step's clock go on from where [`hold`] stopped it."""
        with self._lock:
            if self._holds == 0:
                return
            self._holds -= 1
            if self._holds == 0:
                if self._held is not None:
                    self._began = self._held + (self.clock() - self._held_at)
                self._held = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not timed: the step's clock stops while the block runs (a snapshot's copy of the whole state)."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def compile_began(self) -> None:
        """torch began compiling (see `compile_watch.py`): not timed."""
        self._compile_at = self.clock()
        self.hold()
        self.peers.began()

    def compile_ended(self) -> None:
        """The compilation ended: the clock goes on, and the step may take as long again as the compilation took
        (the other ranks compile the same graphs and may still be at it)."""
        began, self._compile_at = self._compile_at, None
        took = self.clock() - began if began is not None else 0.0
        self._grace += took
        self.release()
        self.peers.ended(self._step, took)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Timed like a step, between steps: a collective of the guard that every rank must reach (the verification
        before a save or an evaluation), where a rank stuck elsewhere would leave the others waiting."""
        if self._began is not None or self._holds:  # inside a step already, or not timed now
            yield
            return
        self._restart_clock(self.clock())
        try:
            yield
        finally:
            self._restart_clock(None)

    def bound(self) -> float:
        return hang_bound(self.slowest, self.timed, self.ceiling, self.factor, learn_after=self.learn_after)

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        self.stop()
        self._stop = threading.Event()
        self._first = True
        self._restart_clock(None)
        self.slowest, self.timed = None, 0  # each `train()` call learns its own bound (its steps may differ)
        self._thread = threading.Thread(target=self._watch, name="safe_trainers-hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._restart_clock(None)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def _watch(self) -> None:
        stop = self._stop
        while not stop.wait(POLL):
            began = self._began
            if began is None or self._reported:
                continue
            elapsed, bound = self.clock() - began, self.bound() + self._grace
            if elapsed > bound:  # another rank may be compiling, or have compiled in this step
                bound += self.peers.excused(self._step, elapsed - bound)
            if elapsed > bound:
                self._hung(elapsed, bound)

    def _hung(self, elapsed: float, bound: float) -> None:
        """Write every thread's stack, say so, record the `hang` event, and end the process at once if a hang
        exits (a hung thread cannot be unwound); otherwise this step is not reported again."""
        self._reported = True
        path = stacks_path(self.output_dir, self.rank)
        slowest = self.slowest
        learned = f"{self.timed} steps timed, slowest {slowest:.3f} s" if slowest is not None else "not learned"
        head = (
            f"=== rank {self.rank}, attempt {self.attempt}: step {self._step} has run {elapsed:.1f} s, past the hang "
            f"bound of {bound:.1f} s ({learned}; hang_timeout={self.ceiling:g}, "
            f"hang_timeout_factor={self.factor:g}). Stacks of every thread: ===\n"
        )
        try:
            write_stacks(path, head)
        finally:
            logger.error(hang_message(self.rank, self._step, elapsed, bound, path, self.exits))
            detail = {"seconds": round(elapsed, 1), "bound": round(bound, 1), "stacks": path, "exited": self.exits}
            try:
                if self.on_hang is not None:
                    self.on_hang(self._step, detail)
            finally:
                if self.exits:
                    exit_hung()


__all__ = [
    "HANG_FLOOR", "HUNG_EXIT_CODE", "HangWatchdog", "generation_period", "hang_bound", "stacks_path",
]  # fmt: skip  (`HUNG_EXIT_CODE` and `stacks_path` live in `hang_report.py`)
