"""The run a safe trainer holds: its guard, step record, preemption, watchdog and hook bookkeeping, in one object
built in one place, and the callbacks installed once, in the order their priorities say.

Callback order, right after transformers' flow callback (which decides whether a step logs, evaluates or saves),
before every other callback (TRL's reference-model sync, the reporting integrations, the user's), highest `priority`
first (each callback declares its own):

* 50 [`HookCheckCallback`] (`hooks_ran.py`): first of all, the upstream hooks the guard depends on ran, or the run
  stops;
* 40 [`PreemptionCallback`]: decides at `on_step_end` whether this step is the one every rank stops at, and asks it
  to save, before the guard verifies;
* 30 [`StepProgressCallback`]: a step is over (for the step record) before the guard inspects, snapshots or rolls
  back, so a death there is never blamed on the step's data;
* 20 [`NanGuardCallback`]: the state is verified before anything after it reads or saves it;
* 10 [`HangWatchdogCallback`]: its `on_step_end` comes after the guard's inspection, so the inspection's collectives are
  timed with the step; then, under several ranks, [`HangRelayCallback`]: it reads back the hangs relayed from the
  other ranks (`hang_relay.py`), at train end once the watchdog stopped;
* 5 [`EventReportCallback`] (`reporting.py`, when `report_to` names TensorBoard or W&B): after the guard's and the
  watchdog's, whose train-end events it reports; it finds the integrations' writers once they opened them;
* 0 [`CompileWatchCallback`]: anywhere; the compile watch tells the step record and the watchdog when torch compiles;
* 0 [`CollapseCallback`] (GRPO, RLOO; `collapse/watch.py`): anywhere; it reads the metrics TRL computed, warn-only.

The callbacks are `callbacks.py`'s; what each drives is a plain object of `restarts/` (or the guard), held by the run.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Callable
from typing import Any

from transformers.trainer_callback import DefaultFlowCallback

from ..collapse.watch import CollapseCallback, CollapseWatch, collapse_detail, collapse_message
from ..guard import NanGuard
from ..guard.backends import state_bytes
from ..restarts.agents import restart_count
from ..restarts.background_save import BackgroundSaves
from ..restarts.checkpoint_choice import checker
from ..restarts.compile_watch import CompileWatch
from ..restarts.deadline import Deadline, job_end_time
from ..restarts.hang_relay import HangRelay
from ..restarts.hang_report import hang_exits
from ..restarts.output_lock import OutputDirLock
from ..restarts.preemption import Preemption, parse_signals
from ..restarts.step_progress import StepProgress
from ..restarts.watchdog import HangWatchdog, generation_period
from ..restarts.writers_done import WritersDone
from ..runtime.events import EventLog, RunEvent
from ..runtime.ports import UNWATCHED
from .callbacks import (
    CompileWatchCallback, HangRelayCallback, HangWatchdogCallback, NanGuardCallback, PreemptionCallback,
    StepProgressCallback,
)  # fmt: skip
from .background_checkpoints import SaveAwareCallbackHandler
from .hooks_ran import HookCheckCallback, HooksRan
from .port import TrainerPort, refuse_unsupported_backend
from .reporting import EventReportCallback, EventReporter, reports_events

logger = logging.getLogger("safe_trainers")
# The trainers whose metrics the collapse watch reads (TRL's GRPO and RLOO name them alike, 1.14 to 1.16).
COLLAPSE_KINDS = ("grpo", "rloo")


@dataclass
class ClosedWindow:
    """A log window the ledger closed where the Trainer decided to log (`loss`: the mean over its applied steps, or
    `None` when the Trainer's own value stands), waiting for the Trainer's `log` call of that window."""

    loss: float | None


@dataclass
class HookState:
    """What the Trainer hooks carry from one Trainer call to the next (`hooks.py`, `checkpoints.py`).

    Args:
        staging (`bool`): `_save_checkpoint` is writing a checkpoint: the Trainer's `_get_output_dir` answers the
            staging directory, and `_push_from_checkpoint` waits for the published one.
        starting_checkpoint (`bool`): the checkpoint being written is the run's starting state (never uploaded).
        window ([`ClosedWindow`] or `None`): closed by `_maybe_log_save_evaluate`, taken by `log`.
        last_finite_total_loss (`float`): the Trainer's last finite running loss total, put back over a NaN one.
        replaying (`bool`): the guard's diagnosis replays a step (`replay.py`): its inputs are not recorded.
        deferred (`list`, *optional*): during a background save's `_save_checkpoint`, the `(ready, write)` pairs of
            the files its writer thread writes (`checkpoints.py`); `None` otherwise.
    """

    staging: bool = False
    starting_checkpoint: bool = False
    window: ClosedWindow | None = None
    last_finite_total_loss: float = 0.0
    replaying: bool = False
    deferred: list[tuple[Callable[[], None], Callable[[], None]]] | None = None


@dataclass
class SafeRun:
    """What a safe trainer's run holds (`trainer.safe_run`). With `nan_guard=False` only the output lock is used.

    Args:
        guard ([`NanGuard`], *optional*): the NaN guard (also `trainer.nan_guard`, for users).
        events ([`EventLog`], *optional*): the run's event log, shared by the guard, the step record, preemption and
            the watchdog.
        port ([`TrainerPort`], *optional*): the guard's view of the trainer, bound when training starts.
        progress ([`StepProgress`], *optional*): the step record across restarts.
        preemption ([`Preemption`], *optional*): with `preempt_signals`.
        watchdog ([`HangWatchdog`], *optional*): with `hang_timeout > 0`.
        compile_watch ([`CompileWatch`], *optional*): tells the step record and the watchdog when torch compiles.
        hooks_ran ([`HooksRan`], *optional*): which of the guard's Trainer hooks ran (`hooks_ran.py`).
        hooks ([`HookState`], *optional*): what the Trainer hooks carry from one call to the next (`hooks.py`).
        callbacks (`list`): the callbacks that bring the Trainer's loop events to the above, highest `priority`
            first (installed once, `install_callbacks`).
        output_lock ([`OutputDirLock`], *optional*): this process's hold on `output_dir` during `train()`.
        saves ([`BackgroundSaves`], *optional*): the checkpoint writer thread, with `save_in_background=True`.
        writers ([`WritersDone`], *optional*): when every rank's writer is done, agreed on the guard's all-reduce.
        hang_relay ([`HangRelay`], *optional*): under several ranks (whatever each rank's `hang_timeout`), carries
            each rank's reported hangs to the main process's event log on the guard's all-reduce.
        collapse ([`CollapseWatch`], *optional*): GRPO/RLOO with `collapse_signals`: the warn-only collapse watch.
        reporter ([`EventReporter`], *optional*): hands the events to TensorBoard and W&B, when `report_to` names
            them (`reporting.py`).
        callbacks_read_only (`bool`): every callback of the trainer, on every rank, leaves the weights and optimizer
            state alone, so a verification holds until the next step trains (`read_only.py`; set at train start).
    """

    guard: NanGuard | None = None
    events: EventLog | None = None
    port: TrainerPort | None = None
    progress: StepProgress | None = None
    preemption: Preemption | None = None
    watchdog: HangWatchdog | None = None
    compile_watch: CompileWatch | None = None
    hooks_ran: HooksRan | None = None
    hooks: HookState | None = None
    callbacks: list[Any] = field(default_factory=list)
    output_lock: OutputDirLock | None = None
    callbacks_read_only: bool = False
    saves: BackgroundSaves | None = None
    writers: WritersDone | None = None
    collapse: CollapseWatch | None = None
    reporter: EventReporter | None = None
    hang_relay: HangRelay | None = None


def build_run(trainer: Any, settings: Any) -> SafeRun:
    """The run of a built trainer: everything the guard needs when `settings.nan_guard` is on (the guard, its event
    log, the step record, preemption with `preempt_signals`, the watchdog with `hang_timeout > 0`, the hang relay under
    several ranks), else nothing but the output lock's place."""
    if not settings.nan_guard:
        return SafeRun()
    refuse_unsupported_backend(trainer)
    args = trainer.args
    events = EventLog(args.output_dir, write=trainer.is_world_process_zero())
    run = SafeRun(events=events, hooks_ran=HooksRan(), hooks=HookState())
    signals, end = parse_signals(settings.preempt_signals), job_end_time(settings.job_end_time, os.environ)

    def held() -> int:  # what a checkpoint writes at least: the weights and, once bound, the optimizer's state
        return state_bytes(run.guard.backend, trainer.model)

    deadline = Deadline(*end, settings.job_end_slack, held) if end is not None else None
    run.preemption = Preemption(events, signals, deadline) if signals or deadline else None
    if args.world_size > 1:  # another rank's hang reaches the main process's event log (`hang_relay.py`); built
        # whatever this rank's `hang_timeout`: every rank must hand the guard's all-reduce the same riders
        main = trainer.is_world_process_zero()
        run.hang_relay = HangRelay(events, args.output_dir, args.process_index, args.world_size, main)
    if settings.hang_timeout > 0:
        run.watchdog = HangWatchdog(
            args.output_dir, args.process_index, settings.hang_timeout, settings.hang_timeout_factor,
            attempt=restart_count(os.environ), learn_after=generation_period(args),
            exits=hang_exits(settings.hang_action, os.environ), action=settings.hang_action,
            on_hang=partial(record_hang, events, run.hang_relay, args.process_index),
        )  # fmt: skip
    clock = run.watchdog if run.watchdog is not None else UNWATCHED
    run.port = TrainerPort()
    if settings.save_in_background:
        run.saves = BackgroundSaves(checker(settings.trusted_checkpoint_globals), partial(published_by_writer, run))
        run.writers = WritersDone(run.saves)
    # Bits that ride on the guard's per-step all-reduce; a single process reads its flags directly.
    riders = (run.preemption, run.writers, run.hang_relay) if args.world_size > 1 else ()
    riders = tuple(rider for rider in riders if rider is not None)
    run.guard = NanGuard(settings, args, run.port, events, clock=clock, riders=riders)
    main, leave_out = trainer.is_world_process_zero(), can_leave_out_a_step(trainer)
    run.progress = StepProgress(events, args.output_dir, main, can_leave_out=leave_out)
    run.compile_watch = CompileWatch([run.progress] + ([run.watchdog] if run.watchdog is not None else []))
    callbacks = [HookCheckCallback(trainer), NanGuardCallback(trainer), StepProgressCallback(run.progress)]
    callbacks.append(CompileWatchCallback(run.compile_watch))
    if run.preemption is not None:
        callbacks.append(PreemptionCallback(run.preemption))
    if run.watchdog is not None:
        callbacks.append(HangWatchdogCallback(run.watchdog))
    if run.hang_relay is not None:  # after the watchdog's: its train end reads the hangs once the watchdog stopped
        callbacks.append(HangRelayCallback(run.hang_relay))
    run.collapse = build_collapse_watch(trainer, settings, events)
    if run.collapse is not None:
        callbacks.append(CollapseCallback(trainer, run.collapse))
    if reports_events(args.report_to):
        run.reporter = EventReporter(main, lambda: run.guard.state.counters(), settings.event_alert_interval)
        events.observers.append(run.reporter)
        callbacks.append(EventReportCallback(trainer, run.reporter))
    run.callbacks = sorted(callbacks, key=lambda callback: -callback.priority)
    return run


def build_collapse_watch(trainer: Any, settings: Any, events: EventLog) -> CollapseWatch | None:
    """The collapse watch of a GRPO or RLOO trainer with `collapse_signals` (`collapse/`): an episode's start is a
    `collapse` event and, on the main process, one warning."""
    if trainer.safety_kind not in COLLAPSE_KINDS or not settings.collapse_signals:
        return None
    main, patience = trainer.is_world_process_zero(), settings.collapse_patience

    def report(step: int, rule: Any, verdict: Any, window: int, streak: int) -> None:
        events.add(RunEvent(step, "collapse", [], [], collapse_detail(rule, verdict, window, patience, streak)))
        if main:
            logger.warning(collapse_message(step, rule, verdict, window, streak))

    return CollapseWatch(settings.collapse_signals, settings.collapse_window, patience, report)


def record_hang(events: EventLog, relay: HangRelay | None, rank: int, step: int, detail: dict[str, Any]) -> None:
    """The watchdog of rank `rank` reported a hang (on its thread): this rank's `hang` event, and, under several
    ranks, the relay to the main process's event log (`hang_relay.py`)."""
    try:
        events.add(RunEvent(step, "hang", [], [rank], detail))
    finally:
        if relay is not None:
            relay.reported(step, detail)


def published_by_writer(run: SafeRun, run_dir: str, step: int) -> None:
    """On a background save's writer thread, as it publishes `checkpoint-<step>`: the step record lists it at once
    (a crash before its readers are told resumes from it) and the deadline learns the save's time."""
    run.progress.published(run_dir, step)
    if run.preemption is not None:
        run.preemption.saved(step)


def install_callbacks(trainer: Any, run: SafeRun) -> None:
    """Put the run's callbacks right after transformers' flow callback, in priority order (the module docstring)."""
    callbacks = trainer.callback_handler.callbacks
    flow = next((i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)), -1)
    callbacks[flow + 1 : flow + 1] = run.callbacks
    if run.saves is not None:  # `on_save` of a checkpoint written in the background: once it is published
        trainer.callback_handler = SaveAwareCallbackHandler.taking_over(trainer.callback_handler, run.saves)


def can_leave_out_a_step(trainer: Any) -> bool:
    """Whether a step's micro-batches can be taken from the dataloader and not trained, leaving every other step's
    batches as they were: not under DeepSpeed, nor when GRPO/RLOO serve several optimizer steps from one generation
    buffer, which they index by the steps actually trained."""
    args = trainer.args
    accumulation = args.gradient_accumulation_steps
    spans_steps = (getattr(args, "steps_per_generation", None) or accumulation) > accumulation
    return not trainer.is_deepspeed_enabled and not spans_steps and getattr(args, "num_iterations", 1) <= 1


__all__ = ["ClosedWindow", "HookState", "SafeRun", "build_run", "install_callbacks"]
