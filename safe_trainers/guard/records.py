"""What the guard writes about what it did: the events of an inspection (overflows, spikes, skips), of a rollback, of
an abort, of non-finite rewards and refused saves, each with its log line, and the messages of the errors it raises.
Each function takes the event log and the facts, records, and returns the event (or the error to raise)."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import TrainingDivergedError
from ..runtime.events import EventLog, RunEvent
from .policy import StepReading, Verdict
from .rollback.actions import Restored
from .state import GuardState

logger = logging.getLogger("safe_trainers")


def record_rollback(
    events: EventLog,
    verdict: Verdict,
    records: list[StepReading],
    diagnosis: dict | None,
    restored: Restored,
    rollbacks: int,
    damaged_ranks: list[int],
    max_steps: int | None = None,
) -> RunEvent:
    """Record and log the `rollback` event of a restore done on `verdict` (`rollbacks`: the count, this one
    included; `damaged_ranks`: the ranks whose state was found non-finite; `max_steps`: the run's last step)."""
    current, step, lr = restored.at_step, restored.step, restored.learning_rate
    bad = [r for r in records if r.bad]
    spiked = verdict.rollback == "loss_spike" or verdict.spikes
    what = sorted({w for r in bad for w in r.what}) or (["loss_spike"] if spiked else [])
    if verdict.rollback == "nonfinite_state":
        what = sorted(set(what) | {"weights_or_optimizer_state"})
    detail = {
        "reason": verdict.rollback,
        "fault_step": verdict.fault_step,
        "restored_step": step,
        "discarded_steps": restored.discarded_steps,
        "learning_rate": lr,
        "rollbacks": rollbacks,
    }
    if diagnosis is not None:
        detail["first_nonfinite_module"] = diagnosis
    ranks = sorted({rank for r in bad for rank in r.bad_ranks} | set(damaged_ranks))
    skipped = {e.step for e in events.events if e.kind == "skip"}
    event = events.add(RunEvent(current, "rollback", what, ranks, detail))
    logger.warning(
        f"NaN guard: restored the weights and optimizer state of step {step} at step {current} "
        f"({verdict.rollback}); {discarded_updates(restored.discarded_steps, skipped)}, and the learning rate is now "
        f"{lr:.3g}. "
        + (f"Training goes on with step {current + 1}." if max_steps is None or current < max_steps else
           "The run ends with the restored state.")  # fmt: skip
    )
    return event


def discarded_updates(since_snapshot: list[int], skipped: set[int]) -> str:
    """What a restore threw away, in words: the updates applied since the snapshot are discarded; the steps among
    them that the guard skipped had no update to discard. Neither's batches are replayed."""
    applied = [s for s in since_snapshot if s not in skipped]
    not_applied = [s for s in since_snapshot if s in skipped]
    if not since_snapshot:
        return "no update is discarded (the state was damaged after the step was verified)"
    were_skipped = f"{_steps(not_applied)} {'was' if len(not_applied) == 1 else 'were'} skipped" if not_applied else ""
    if not applied:
        return f"no applied update is discarded ({were_skipped})"
    also = f" ({were_skipped})" if not_applied else ""
    return f"the updates of {_steps(applied)} are discarded{also}, their batches are not replayed"


def _steps(steps: list[int]) -> str:
    """`step 9`, `steps 5-7` (a run) or `steps 5, 7`."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}"
    return f"steps {', '.join(map(str, steps))}"


def diverged_error(
    events: EventLog,
    verdict: Verdict,
    restored: Restored,
    state: GuardState,
    rollbacks_this_run: int,
    max_rollbacks: int,
    checkpoint: str | None,
) -> TrainingDivergedError:
    """The run stops over a restored last good state that the caller saved as `checkpoint` (`None`: the save
    failed): record an `abort` event and return the [`TrainingDivergedError`] to raise. `state` holds the guard's
    counters and LR backoff (saved with the checkpoint)."""
    detail = {
        "reason": verdict.rollback,
        "fault_step": verdict.fault_step,
        "restored_step": restored.step,
        "rollbacks": state.rollbacks,
        "learning_rate": restored.learning_rate,
        "checkpoint": checkpoint,
    }
    events.add(RunEvent(restored.at_step, "abort", [verdict.rollback or "unknown"], [], detail))
    head = (
        f"Training diverged: {where_it_started(verdict, restored.at_step)} ({verdict.rollback}) after "
        f"{rollbacks_this_run} rollback(s) (`nan_max_rollbacks={max_rollbacks}`); every event is in {events.path}."
    )
    return TrainingDivergedError(
        abort_message(head, restored, checkpoint, state.lr_scale), checkpoint_dir=checkpoint, report_path=events.path
    )


def where_it_started(verdict: Verdict, at_step: int) -> str:
    if verdict.fault_step is None:  # the state was found damaged with no faulty step (e.g. before a generation)
        return f"the weights or optimizer state were found non-finite at step {at_step}"
    return f"step {verdict.fault_step} started a fault"


def abort_message(head: str, restored: Restored, checkpoint: str | None, lr_scale: float) -> str:
    if checkpoint is None:
        return f"{head} The last good state (step {restored.step}) could not be saved (see the log)."
    return (
        f"{head} The last good weights (those of step {restored.step}) were saved as {checkpoint}, with the learning "
        f"rate already backed off to {restored.learning_rate:.3g} (x{lr_scale:g}). To go on from there, past the "
        f"batches that diverged: `trainer.train(resume_from_checkpoint={checkpoint!r})` (scripts: "
        f"`--resume_from_checkpoint {checkpoint}`). A lower `learning_rate` passed when resuming is applied too (the "
        "backoff multiplies it); also check the data around the listed steps, or raise `nan_max_rollbacks`."
    )


def record_window(
    events: EventLog, verdict: Verdict, diagnosis: dict | None, state: GuardState, spikes_skipped: bool = True
) -> None:
    """Record one inspection's steps as events, in step order: the loss scaler's own skips (`overflow`, not faults),
    the spiking steps (`spike`; `spikes_skipped`: their update was not applied, under DeepSpeed it was and a rollback
    follows) and the steps whose update was prevented (`skip`, the first with the `diagnosis`); log the last two and
    count all three in `state`, the guard's counters."""
    made = [RunEvent(r.step, "overflow", ["grad_norm"], [], {"loss": r.loss}) for r in verdict.overflows]
    made += [
        RunEvent(r.step, "spike", [], [], {"loss": r.judged_loss, "grad_norm": r.grad_norm}) for r in verdict.spikes
    ]
    for i, record in enumerate(verdict.skipped):
        detail: dict[str, Any] = {"loss": record.loss, "grad_norm": record.grad_norm}
        if i == 0 and diagnosis is not None:
            detail["first_nonfinite_module"] = diagnosis
        made.append(RunEvent(record.step, "skip", record.what, list(record.bad_ranks), detail))
    spikes, skipped = [r.step for r in verdict.spikes], [r.step for r in verdict.skipped]
    # Counted before the events are added: an event's observers (W&B's run summary, `trainer/reporting.py`) read the
    # counters as they are with it; a process that dies before the next event or the end of training leaves them so.
    state.overflow_steps += len(verdict.overflows)
    state.spike_steps += len(spikes)
    state.skipped_steps += len(skipped)
    for event in sorted(made, key=lambda event: event.step):  # stable: one step is never two of these kinds
        events.add(event)
    if spikes and spikes_skipped:
        logger.warning(
            f"NaN guard: {len(spikes)} update(s) whose loss or gradient norm spiked far above the recent steps' were "
            f"not applied (steps {spikes}; `nan_spike_factor=0` turns this off). See {events.path}."
        )
    if skipped:
        logger.warning(
            f"NaN guard: {len(skipped)} update(s) with a non-finite loss or gradient were not applied "
            f"(steps {skipped}). See {events.path}."
        )


def record_rewards(events: EventLog, step: int, nonfinite: int, total: int, whole_groups: int) -> RunEvent:
    """GRPO/RLOO: some rewards of step `step` came back NaN/None/Inf (gathered counts, identical on every rank)."""
    detail = {"nonfinite_rewards": nonfinite, "completions": total, "unscorable_groups": whole_groups}
    return events.add(RunEvent(step, "reward", ["rewards"], [], detail))


def nonfinite_start_message(ranks: list[int]) -> str:
    """Why training cannot start under the guard: the state is non-finite before the first step."""
    return (
        f"The model's weights or optimizer state are already non-finite before the first step (rank(s) {ranks}): "
        "there is no good state to keep. Check the checkpoint you load, or the dtype it is loaded in."
    )


def refuse_save(events: EventLog, step: int) -> RunEvent:
    """Record and log that a checkpoint was not written because the state is non-finite."""
    event = events.add(RunEvent(step, "save_refused", ["weights_or_optimizer_state"], [], {}))
    logger.error(
        f"NaN guard: checkpoint-{step} was NOT written: the weights or optimizer state are non-finite. The last "
        "clean checkpoint is kept."
    )
    return event


__all__ = [
    "diverged_error", "discarded_updates", "nonfinite_start_message", "record_rewards", "record_rollback",
    "record_window", "refuse_save",
]  # fmt: skip
