"""The run's callbacks: where the Trainer's loop events reach the guard ([`NanGuardCallback`]) and the parts of the run
that outlive a process (preemption, the step record, the hang watchdog, the compile watch; `restarts/`), each with the
`priority` that places it among the others (`run.py`)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..restarts.compile_watch import CompileWatch
from ..restarts.hang_relay import HangRelay
from ..restarts.preemption import Preemption
from ..restarts.step_progress import StepProgress
from ..restarts.watchdog import HangWatchdog
from . import inspection
from .read_only import due_unless_settled


class NanGuardCallback(TrainerCallback):
    """Takes the first snapshot at train start, hands the skip flag to the optimizer before each step (and takes it
    back after it; the step waits for a snapshot's copies still in flight, on the device), and inspects the recent
    steps (skip, roll back, snapshot) at the end of each step and epoch, after the Trainer's flow callback decided
    whether this step logs, evaluates, saves or ends training, and before it does any of them.

    Args:
        trainer: the safe trainer whose run's guard this drives (`trainer.safe_run`).
    """

    priority = 20  # see `run.py`: after the step record's, before the watchdog's
    leaves_state_alone = True  # see `read_only.py`

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs: Any):
        inspection.begin(self.trainer)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs: Any):
        self.trainer.safe_run.guard.apply_skip(optimizer if optimizer is not None else self.trainer.optimizer)
        inspection.before_write(self.trainer)  # the update waits, on the device, for a snapshot's copies in flight

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs: Any):
        self.trainer.safe_run.guard.after_update(optimizer if optimizer is not None else self.trainer.optimizer)

    def on_step_end(self, args, state, control, **kwargs: Any):
        self._at_boundary(control, state)

    def on_epoch_end(self, args, state, control, **kwargs: Any):
        self._at_boundary(control, state)

    def on_train_end(self, args, state, control, **kwargs: Any):
        inspection.inspect(self.trainer)

    def _at_boundary(self, control: Any, state: Any) -> None:
        run = self.trainer.safe_run
        last = state.global_step >= state.max_steps
        due = due_unless_settled(run.guard, control, last) if run.callbacks_read_only else run.guard.due(control)
        if due is not None:
            verify, snapshot = due
            # The last step's state is verified, not copied, when nothing after it can change it (`read_only.py`):
            # no step is left to roll back from.
            snapshot = snapshot and not (last and run.callbacks_read_only)
            inspection.inspect(self.trainer, verify=verify, snapshot=snapshot)


class PreemptionCallback(TrainerCallback):
    """Has the step every rank stops at for a preemption save and end training ([`Preemption`])."""

    priority = 40  # see `run.py`: before the step record and the guard
    leaves_state_alone = True  # see `read_only.py`

    def __init__(self, preemption: Preemption):
        self.preemption = preemption

    def on_train_begin(self, args, state, control, **kwargs: Any):
        self.preemption.train_began(state)

    def on_step_begin(self, args, state, control, **kwargs: Any):
        self.preemption.step_began()

    def on_step_end(self, args, state, control, **kwargs: Any):
        if self.preemption.step_ended(state.global_step, steps_left=state.max_steps - state.global_step):
            control.should_save = True
            control.should_training_stop = True
        if control.should_save:
            self.preemption.save_began(state.global_step)

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.preemption.restore()


class StepProgressCallback(TrainerCallback):
    """Tells the step record when each optimizer step begins and ends ([`StepProgress`])."""

    priority = 30  # see `run.py`: after preemption, before the guard
    leaves_state_alone = True  # see `read_only.py`

    def __init__(self, progress: StepProgress):
        self.progress = progress

    def on_step_begin(self, args, state, control, **kwargs: Any):
        self.progress.step_began(state.global_step + 1, args.gradient_accumulation_steps)

    def on_step_end(self, args, state, control, **kwargs: Any):
        self.progress.step_ended(state.global_step)

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.progress.train_ended(state.global_step)


class HangWatchdogCallback(TrainerCallback):
    """Times each optimizer step with the [`HangWatchdog`]."""

    priority = 10  # see `run.py`: after the guard, whose inspection is timed with the step
    leaves_state_alone = True  # see `read_only.py`

    def __init__(self, watchdog: HangWatchdog):
        self.watchdog = watchdog

    def on_train_begin(self, args, state, control, **kwargs: Any):
        self.watchdog.train_began(state.is_world_process_zero)

    def on_step_begin(self, args, state, control, **kwargs: Any):
        self.watchdog.step_began(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs: Any):
        self.watchdog.step_ended()

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.watchdog.stop()


class HangRelayCallback(TrainerCallback):
    """Under several ranks, reads back the hangs the other ranks' watchdogs reported ([`HangRelay`]); on every rank,
    whatever its `hang_timeout` (the relay rides on the guard's all-reduce, which every rank must hand the same
    values). Placed after [`HangWatchdogCallback`] (`run.py`): at train end this rank's watchdog has stopped."""

    priority = 10  # see `run.py`: after the guard's and the watchdog's
    leaves_state_alone = True  # see `read_only.py`

    def __init__(self, relay: HangRelay):
        self.relay = relay

    def on_train_begin(self, args, state, control, **kwargs: Any):
        self.relay.train_began()

    def on_step_end(self, args, state, control, **kwargs: Any):
        self.relay.step_ended(state.global_step)

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.relay.train_ended()


class CompileWatchCallback(TrainerCallback):
    """Keeps the [`CompileWatch`] registered with TorchDynamo while training runs."""

    priority = 0  # see `run.py`: anywhere
    leaves_state_alone = True  # see `read_only.py`

    def __init__(self, watch: CompileWatch):
        self.watch = watch

    def on_train_begin(self, args, state, control, **kwargs: Any):
        self.watch.register()

    def on_step_begin(self, args, state, control, **kwargs: Any):
        self.watch.register()  # again if `torch._dynamo.reset()` cleared every callback (every graph compiles again)

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.watch.unregister()
