"""Where `train()` starts: from scratch, from the checkpoint it was given, or from the newest healthy checkpoint.

A process killed by a signal (SIGKILL, SIGFPE, a segfault, a CUDA device-side assert, an NCCL timeout) cannot save
anything. torchrun's elastic agent (`torchrun --max-restarts N`, `accelerate launch --max_restarts N`) starts the
workers again, with the same command line, and tells them so in `TORCHELASTIC_RESTART_COUNT` (its documented contract
with the workers). With `resume_on_restart=True` such a restarted `train()` resumes from the newest complete and finite
checkpoint of `output_dir` with nothing else passed, as `resume_from_checkpoint=True` does (see
`checkpoint_choice.py`), and inherits the run's history of deaths (see `progress.py`).

It trusts only what its own launch wrote: the step record names the launch by what the elastic agent keeps across
its restarts (see `agents.py`; never a parent process id or a file time), the script's `train()` call, and the
checkpoints the launch published. A call that had finished before the restart (the process died in `save_model` or
in the script's next stage) trains no step: it resumes from its final checkpoint, where the trainer stops before
fetching a batch, and returns what it returned before.

[`plan_resume`] is the decision, free of side effects: from the launcher's environment, the `output_dir` contents and
the settings to a [`ResumePlan`]. [`resolve_run`] takes it on the main process, hands it to every rank (so all ranks
resume from the same checkpoint) and reports it; [`record_resume`] writes the `resume` event.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from accelerate.utils import broadcast_object_list, gather_object

from ..runtime.checkpoint_dirs import checkpoint_step
from ..runtime.events import EventLog, RunEvent
from .agents import TrainCalls, agent_identity, launch_agents, restart_count, same_launch
from .checkpoint_choice import (
    CheckpointChoice,
    PassedOver,
    checker,
    checkpoint_problem,
    choose_checkpoint,
    safety_problem,
)  # fmt: skip
from .progress import History, Progress, data_identity, inherit, read_progress

logger = logging.getLogger("safe_trainers")

ResumeReason = Literal["new", "explicit", "requested", "restart"]
NOT_THIS_LAUNCHS = "not this launch's (an earlier run's, or published after the launch's step record was last written)"


@dataclass(frozen=True)
class ResumePlan:
    """How `train()` starts.

    Args:
        checkpoint (`str | None`): the checkpoint to resume from (`None`: from scratch).
        reason (`str`): `"new"` (a new run), `"explicit"` (a checkpoint path was passed), `"requested"`
            (`resume_from_checkpoint=True`) or `"restart"` (restarted by the elastic agent).
        restart (`int`): the launcher's restart count (0: first start, or no elastic agent).
        passed_over ([`PassedOver`] tuple): newer checkpoints that were not usable, newest first, with the reason.
        history ([`History`]): what this process inherits from the run's earlier processes.
        data (`str`): the run's data identity (see `progress.data_identity`).
        finished (`bool`): this `train()` call of the launch already finished before the restart: it trains no step
            and returns what it returned then (`history.result`).
    """

    checkpoint: str | None
    reason: ResumeReason
    restart: int = 0
    passed_over: tuple[PassedOver, ...] = ()
    history: History = field(default_factory=History)
    data: str = ""
    finished: bool = False


def resume_reason(requested: str | bool | None, restart: int, resume_on_restart: bool) -> ResumeReason:
    """Why the run resumes, or `"new"`: an explicit path wins, then `True`, then a restart by the elastic agent."""
    if isinstance(requested, str):
        return "explicit"
    if requested is True:
        return "requested"
    return "restart" if restart > 0 and resume_on_restart else "new"


def plan_resume(
    requested: str | bool | None,
    env: Mapping[str, str],
    output_dir: str,
    *,
    resume_on_restart: bool = True,
    skip_after: int = 2,
    data: str = "",
    launch: tuple[str, ...] = (),
    stage: int = 1,
    trusted: tuple[str, ...] = (),
    choose: Callable[..., CheckpointChoice] = choose_checkpoint,
    previous: Callable[[str], Progress | None] = read_progress,
) -> ResumePlan:
    """Decide how `train()` starts (see the module docstring). `choose` and `previous` read `output_dir`; `launch`
    names this launch's elastic agents (`launch.launch_agents`), `stage` this `train()` call of the script
    (`launch.TrainCalls`) and `trusted` the globals a checkpoint's pickled state may hold beyond the allowlist
    (`trusted_checkpoint_globals`).

    An explicit checkpoint path is the user's choice: it is not checked for completeness or finiteness, but a path
    whose DeepSpeed or DCP state would run code it carries raises `ValueError` naming the file and the global.

    A restarted process trusts only the record its own launch wrote for the same `train()` call: with none (the
    launch died before this call began training, or the record in `output_dir` is an earlier run's), it starts over,
    as without an elastic agent; with one, it resumes from the newest healthy checkpoint this launch published or
    began from, never an earlier run's, and a call that had finished trains no step. Raises `ValueError` when a later
    `train()` call of the launch wrote its record (and its checkpoints) over this call's, in the same `output_dir`.
    """
    restart = restart_count(env)
    reason = resume_reason(requested, restart, resume_on_restart)
    record = previous(output_dir)
    known = record.history if record is not None else None
    launchs = resume_on_restart and known is not None and same_launch(known.launch, known.restart, launch, restart)
    if launchs and known.stage > stage:
        raise ValueError(shared_output_dir_message(output_dir, stage, known.stage))
    own = launchs and known.stage == stage
    if reason == "explicit" and own:
        # Restarted with the command line that named a checkpoint: go on from this launch's newest, not back there.
        choice = choose(output_dir, this_launchs(record, trusted))
        if choice.path is not None:
            reason = "restart"
    if reason == "restart" and not own:
        return ResumePlan(None, reason, restart, (), History(launch=launch, restart=restart, stage=stage), data)
    if reason == "restart":
        choice = choose(output_dir, this_launchs(record, trusted))
    elif reason == "requested":
        choice = choose(output_dir, checker(trusted))
    else:
        choice = CheckpointChoice(requested if reason == "explicit" else None)
    if reason == "explicit" and os.path.isdir(requested):
        unsafe = safety_problem(requested, trusted)
        if unsafe is not None:
            raise ValueError(f"`resume_from_checkpoint={requested!r}` is {unsafe}.")
    continuing = reason != "new" or restart > 0
    history = replace(inherit(record, continuing, data, skip_after), launch=launch, restart=restart, stage=stage)
    if reason == "restart":  # the launch's record goes on
        history = replace(history, origin=known.origin, checkpoints=known.checkpoints, result=known.result)
    else:  # the launch's first process for this call: its own record starts here
        history = replace(history, origin=choice.path, checkpoints=(), result=None)
    finished = reason == "restart" and record.finished
    return ResumePlan(choice.path, reason, restart, choice.passed_over, history, data, finished)


def this_launchs(record: Progress, trusted: tuple[str, ...] = ()) -> Callable[[str], str | None]:
    """A checkpoint `problem` for a restart: a checkpoint the launch neither published (the record lists their steps)
    nor began from is passed over, every other is checked as usual (`checkpoint_choice.checkpoint_problem`)."""
    origin = os.path.normpath(record.history.origin) if record.history.origin else None
    published = record.history.checkpoints

    def problem(path: str) -> str | None:
        if os.path.normpath(path) != origin and checkpoint_step(path) not in published:
            return NOT_THIS_LAUNCHS
        return checkpoint_problem(path, trusted)

    return problem


def shared_output_dir_message(output_dir: str, stage: int, later: int) -> str:
    return (
        f"This restarted script's `train()` call #{stage} with `output_dir={output_dir!r}` had finished before the "
        f"restart, but call #{later} of the same launch used the same `output_dir` since: its step record and its "
        "checkpoints replaced this call's (checkpoints of the same step have the same name), so the finished state "
        "cannot be brought back. Give each `train()` call of a script its own `output_dir`, or run the stages as "
        "separate launches."
    )


def resolve_run(args: Any, settings: Any, rows: int | None, requested: str | bool | None) -> ResumePlan:
    """Plan on the main process, hand the plan to every rank, report it; raise if `True` found no checkpoint.

    Args:
        args: the trainer's config (`output_dir`, `process_index`, what identifies the data order).
        settings ([`SafetyArguments`], *optional*): the `resume_on_restart`, `skip_step_after_crashes` and
            `trusted_checkpoint_globals` settings (`None`: their defaults).
        rows (`int | None`): the training dataset's length, when it has one.
        requested: `train()`'s `resume_from_checkpoint`.
    """
    stage = TrainCalls.next(args.output_dir)
    agents = launch_agents(gather_object([agent_identity(os.environ)]))  # one collective: every node's agent
    plan: ResumePlan | ValueError | None = None
    if args.process_index == 0:
        try:
            plan = plan_resume(
                requested if requested is not False else None,
                os.environ,
                args.output_dir,
                resume_on_restart=getattr(settings, "resume_on_restart", True),
                skip_after=getattr(settings, "skip_step_after_crashes", 2),
                data=data_identity(args, rows),
                launch=agents,
                stage=stage,
                trusted=tuple(getattr(settings, "trusted_checkpoint_globals", None) or ()),
            )
        except ValueError as error:  # raised on every rank, after the broadcast
            plan = error
    plan = broadcast_object_list([plan])[0]
    if isinstance(plan, ValueError):
        raise plan
    if plan.reason == "requested" and plan.checkpoint is None:
        raise ValueError(no_checkpoint_message(args.output_dir, plan.passed_over))
    if args.process_index == 0:
        _log(plan)
    return plan


def record_resume(events: EventLog, plan: ResumePlan) -> None:
    """Add the `resume` event (after the guard started its run: the event log is the resumed one) when the resume
    logic chose the checkpoint, or earlier processes of the run died; an explicit path after a clean run adds none."""
    if plan.reason in ("new", "explicit") and not plan.restart and not plan.history.deaths:
        return
    step = checkpoint_step(plan.checkpoint) if plan.checkpoint else 0
    detail = {
        "checkpoint": plan.checkpoint,
        "reason": plan.reason,
        "restart": plan.restart,
        "attempt": plan.history.attempt,
        "passed_over": [p.to_dict() for p in plan.passed_over],
        "deaths": [{"attempt": d.attempt, "step": d.step} for d in plan.history.deaths],
    }
    if plan.finished:
        detail["finished"] = (plan.history.result or {}).get("global_step", step)
    events.add(RunEvent(step or 0, "resume", [], [], detail))


def no_checkpoint_message(output_dir: str, passed_over: tuple[PassedOver, ...]) -> str:
    if passed_over:
        found = "; ".join(f"`{os.path.basename(p.path)}`: {p.reason}" for p in passed_over)
        head = f"every checkpoint in {output_dir} was passed over ({found})"
    else:
        head = f"{output_dir} holds no `checkpoint-N` directory"
    return (
        f"`resume_from_checkpoint=True` found no checkpoint to resume from: {head}. Pass the path of a checkpoint to "
        "resume from, or `resume_from_checkpoint=None` to start a new run."
    )


def _log(plan: ResumePlan) -> None:
    for skipped in plan.passed_over:
        logger.warning(f"Resume: passed over {skipped.path}: {skipped.reason}.")
    if plan.history.deaths:
        where = ", ".join(
            f"attempt {d.attempt} " + (f"at step {d.step}" if d.step is not None else "between steps")
            for d in plan.history.deaths[-3:]
        )
        logger.warning(f"Earlier processes of this run died: {where}.")
    if plan.reason == "new" and plan.restart:
        logger.warning(f"Restart {plan.restart} by the elastic agent with `resume_on_restart=False`: starting over.")
    if plan.finished:
        source = f"from {plan.checkpoint}" if plan.checkpoint else "with no checkpoint left: it trains again"
        logger.warning(
            f"Resume (restart {plan.restart} by the elastic agent): this `train()` call finished before the restart; "
            f"it returns its final state ({source}) and trains no step past the end."
        )
    elif plan.reason in ("requested", "restart"):
        cause = f"restart {plan.restart} by the elastic agent" if plan.reason == "restart" else "requested"
        if plan.checkpoint is None:
            logger.warning(f"Resume ({cause}): no checkpoint yet, training starts from step 0.")
        else:
            logger.warning(f"Resume ({cause}): from {plan.checkpoint}, the newest complete and finite checkpoint.")
