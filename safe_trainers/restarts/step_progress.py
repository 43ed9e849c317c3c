"""[`StepProgress`]: keeps the step record on disk and skips the batches of a poisoned step (the Trainer's loop events
reach it through `trainer/callbacks.py`).

The record (see `progress.py`) is rewritten by the main process when each optimizer step begins and ends, when torch
begins and ends a compilation inside a step, when a checkpoint is published (the record lists the launch's
checkpoints), and when training ends (with what `train()` returns). A step whose batches killed the process
`skip_step_after_crashes` times in a row is *poisoned*: when it comes, its micro-batches are taken from the dataloader
as usual (so every other step reads exactly the batches it would have) but not trained: no forward, no backward, no
update. The guard counts it as a skipped step (`nan_guard/skipped_steps`, a `skip` event) and a `poison` event says
which batches and which attempts died on them; `global_step` and the LR schedule go on, as for any skipped step, and the
run ends at `max_steps`.

Under DeepSpeed the engine counts micro-batches in its own backward, and GRPO/RLOO serving several optimizer steps from
one generation buffer index it by the steps trained, so there a step cannot be left out: a poisoned step is reported
(`"skipped": false`) and trained.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from ..runtime.checkpoint_dirs import checkpoint_dir
from ..runtime.events import EventLog, RunEvent
from .progress import History, Phase, Poisoned, ProgressWriter

logger = logging.getLogger("safe_trainers")


class StepProgress:
    """Writes the step record and drops the micro-batches of poisoned steps (see the module docstring).

    Args:
        events ([`EventLog`]): the run's event log (the poisoned steps).
        output_dir (`str`): where the step record is kept.
        main (`bool`): this is the main process (it writes the record).
        can_leave_out (`bool`): a poisoned step's batches can be left untrained ([`can_leave_out_a_step`]).
    """

    def __init__(self, events: EventLog, output_dir: str, main: bool, can_leave_out: bool = True):
        self.events, self.output_dir, self.main, self.can_leave_out = events, output_dir, main, can_leave_out
        self.history = History()
        self.dropping = False
        self._writer: ProgressWriter | None = None
        self._last: tuple[int, Phase] = (0, "between")
        self.step_seconds = 0.0  # this process's time inside optimizer steps (the record stamps it)
        self._step_began: float | None = None
        self._lock = threading.RLock()  # a background save's writer thread records its publication (`published`)

    def start(self, history: History, data: str, step: int = 0) -> None:
        """Called by `train()` with what this process inherits from the run's earlier processes, and the step it
        resumes at. The record is written at once (between steps): a death while the run starts up (loading,
        wrapping the model, the first snapshot) keeps the run's history and is never blamed on a step's data."""
        self.history, self.dropping = replace(history, began=time.time(), first_step=step), False
        self.step_seconds, self._step_began = 0.0, None
        if self._writer is not None:
            self._writer.close()
        self._writer = ProgressWriter(self.output_dir, self.history, data) if self.main else None
        self._save(step, "between")

    @staticmethod
    def dropped_loss(device: Any) -> torch.Tensor:
        """What `training_step` returns for a dropped micro-batch: no loss (NaN), as for any skipped step."""
        return torch.full((), float("nan"), device=device)

    def step_began(self, step: int, accumulation: int) -> None:
        """Optimizer step `step` begins (of `accumulation` micro-batches): a poisoned step's batches are dropped."""
        poisoned = self.history.poisoned_step(step)
        if poisoned is not None:
            self.dropping = self.can_leave_out
            self._report(step, poisoned, accumulation)
        self._step_began = time.perf_counter()
        self._save(step, "step")

    def step_ended(self, step: int) -> None:
        self.dropping = False
        if self._step_began is not None:
            self.step_seconds += time.perf_counter() - self._step_began
            self._step_began = None
        self._save(step, "between")

    def train_ended(self, step: int) -> None:
        self._save(step, "finished")

    def compile_began(self) -> None:
        """torch began compiling (see `compile_watch.py`): inside a step, the record says the step is compiling."""
        step, phase = self._last
        if phase == "step":
            self._save(step, "compile")

    def compile_ended(self) -> None:
        step, phase = self._last
        if phase == "compile":
            self._save(step, "step")

    def published(self, run_dir: str, step: int) -> None:
        """The trainer published `checkpoint-<step>` (and rotated): the record lists the steps of this launch's
        checkpoints still in `run_dir`, the only ones a restart of the launch resumes from."""
        with self._lock:  # also called on a background save's writer thread, as it publishes
            steps = sorted(set(self.history.checkpoints) | {step})
            kept = tuple(s for s in steps if os.path.isdir(checkpoint_dir(run_dir, s)))
            self._update(replace(self.history, checkpoints=kept))

    def finished(self, output: Any) -> None:
        """`train()` returns `output` (a `TrainOutput`): the record keeps it, for a restart of the launch to return
        it again without training; the record is closed."""
        result = {"global_step": output.global_step, "training_loss": output.training_loss, "metrics": output.metrics}
        self._update(replace(self.history, result=result))
        self._save(output.global_step, "finished")
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _update(self, history: History) -> None:
        with self._lock:
            self.history = history
            if self._writer is not None:
                self._writer.history = history
                self._writer.write(*self._last, time.time(), self.step_seconds)

    def _save(self, step: int, phase: Phase) -> None:
        with self._lock:
            self._last = (step, phase)
            if self._writer is not None:
                self._writer.write(step, phase, time.time(), self.step_seconds)

    def _report(self, step: int, poisoned: Poisoned, accumulation: int) -> None:
        batches = [(step - 1) * accumulation, step * accumulation - 1]
        detail = {"attempts": list(poisoned.attempts), "micro_batches": batches, "skipped": self.dropping}
        self.events.add(RunEvent(step, "poison", [], [], detail))
        if self._writer is None:  # the main process reports
            return
        attempts = " and ".join(str(a) for a in poisoned.attempts)
        if self.dropping:
            logger.warning(
                f"Step {step}'s batches (micro-batches {batches[0]}-{batches[1]} of each rank's stream) killed the "
                f"training process in attempts {attempts} in a row: they are skipped, not trained. Training goes on "
                f"with step {step + 1}. Set `skip_step_after_crashes=0` to always train every batch."
            )
        else:
            logger.error(
                f"Step {step}'s batches killed the training process in attempts {attempts} in a row, but this run "
                "cannot leave a step out (DeepSpeed counts micro-batches in its own backward; GRPO/RLOO with "
                "`steps_per_generation` above `gradient_accumulation_steps` or `num_iterations` > 1 index their "
                "generation buffer by step): they are trained again."
            )
