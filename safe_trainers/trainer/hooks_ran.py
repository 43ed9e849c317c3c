"""Never silently unguarded: the upstream hooks the NaN guard depends on ran in this `train()` call, or it stops.

The guard lives in overrides of transformers' and TRL's private methods (`_get_grad_norm`, `_save_checkpoint`,
`_generate_and_score_completions`, ...). The day an upstream release renames one, or stops calling it, the override
is dead code and the run trains unprotected while looking protected. So each of the guard's hooks marks a
[`HooksRan`] record when it runs (a dictionary write, no host sync), and [`HookCheckCallback`] verifies the record
against the rows of `safe_trainers/upstream/table.py` that carry a `check`:

* before the first optimizer step of the `train()` call is applied (`on_pre_optimizer_step`): the per-step hooks (the
  gradient hook, the loss accumulator, GRPO/RLOO's generation hooks, resume) ran, and the Trainer attributes the
  guard reads exist; so a missing per-step hook stops the run before its first unguarded update;
* at the end of that step: the `on_pre_optimizer_step` event itself fired (the guard's skip is handed over there);
* once that step's log and save are over (the next `on_step_begin`, or `on_train_end`): the log window closed;
* at every save: the checkpoint went through the guard's staging path (checked by `_save_checkpoint` before it
  publishes, and at `on_save`).

A failed check raises [`UpstreamHookError`] naming the hooks, the installed versions and the supported ranges. Every
rank holds the same record (the same code ran) and checks at the same event, without a collective, so all ranks raise
together and none waits in a collective for a rank that stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from transformers import TrainerCallback

from ..errors import UpstreamHookError
from ..upstream.names import resolve_owner
from ..upstream.table import TOUCHPOINTS
from ..upstream.touchpoint import CHECK_TEXT, Check, Touchpoint
from ..upstream.versions import current_versions_note

CHECKED: tuple[Touchpoint, ...] = tuple(row for row in TOUCHPOINTS if row.check is not None)

# When a row's check applies (its `when`), read from the trainer.
# Each reads the trainer and the step checked (a background save's `on_save` comes after later steps).
CONDITIONS: dict[str, Callable[[Any, int], bool]] = {
    "resumed": lambda trainer, step: trainer.safe_run.guard.resumed_from is not None,
    "vllm": lambda trainer, step: bool(getattr(trainer.args, "use_vllm", False)),
    # The guard's `_save_checkpoint` ran at this step and wrote the checkpoint (it did not refuse a damaged state).
    "saved": lambda trainer, step: _wrote_checkpoint(trainer.safe_run.hooks_ran, step),
}


class HooksRan:
    """Which of the guard's hooks ran in this `train()` call, and at which `global_step` each last ran.

    Attributes:
        steps (`dict[str, int]`): hook name -> the `global_step` of its last run in this `train()` call (`-1` where
            the step does not matter).
        checked (`set[str]`): the checks passed in this `train()` call (see [`HookCheckCallback`]).
        refused_save (`int`): the step of the last checkpoint the guard refused to write (a non-finite state).
    """

    def __init__(self):
        self.steps: dict[str, int] = {}
        self.checked: set[str] = set()
        self.refused_save = -1

    def ran(self, name: str, step: int = -1) -> None:
        self.steps[name] = step

    def clear(self) -> None:
        """Forget everything: called by `train()` before the Trainer's (which loads a checkpoint to resume from before
        `on_train_begin`), so each `train()` call proves its own hooks."""
        self.steps.clear()
        self.checked.clear()
        self.refused_save = -1


def unran_hooks(
    rows: Iterable[Touchpoint],
    check: Check,
    ran: Mapping[str, int],
    attributes: Collection[str],
    owners: Collection[str],
    holds: Collection[str],
    step: int,
) -> list[Touchpoint]:
    """The rows of `check` that the training loop did not go through.

    Args:
        rows: the table's rows.
        check: the check being made (see `Check` in `safe_trainers/upstream/touchpoint.py`).
        ran: the [`HooksRan`] record, hook name -> step of its last run.
        attributes: the attribute names the trainer has, among the rows'.
        owners: the rows' owners that apply to the trainer (`"trl:GRPOTrainer"` only to GRPO).
        holds: the conditions (`when`) that hold for this run.
        step: the current `global_step` (a save's hooks must have run at this step).

    Returns:
        The rows whose method did not run (at this step, for a save) or whose attribute is missing, one per name.
    """
    missing: dict[str, Touchpoint] = {}
    for row in rows:
        if row.check != check or row.owner not in owners or (row.when is not None and row.when not in holds):
            continue
        if row.kind == "attribute":
            went_through = row.name in attributes
        else:
            went_through = row.name in ran and (check != "save" or ran[row.name] == step)
        if not went_through:
            missing.setdefault(row.name, row)
    return list(missing.values())


MISSING = {False: "was not called", True: "does not exist"}  # a hook, an attribute


def hook_error_message(missing: list[Touchpoint], check: Check, versions_note: str) -> str:
    """The [`UpstreamHookError`] message: what did not happen, what it is for, the versions and the way out."""
    parts = [f"`{row.label}` {MISSING[row.kind == 'attribute']} ({row.purpose}; {row.added})" for row in missing]
    return (
        f"The NaN guard cannot protect this run: the training loop did not go through the guard's hooks "
        f"{CHECK_TEXT[check]}: {'; '.join(parts)}. An upstream release changed the training loop, or a subclass "
        f"overrides the hook without calling `super()`. {versions_note} Install versions in the supported ranges "
        "(docs/design/upstream.md lists every hook), or set `nan_guard=False` to train without the guard, the "
        "documented way to train unprotected."
    )


class HookCheckCallback(TrainerCallback):
    """Verifies the [`HooksRan`] record at the events of the module docstring; raises [`UpstreamHookError`].

    Args:
        trainer: the safe trainer (its `hooks_ran` record is the one checked).
    """

    priority = 50  # see `run.py`: first of all
    leaves_state_alone = True  # see `read_only.py`

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self._stepped = False

    def on_train_begin(self, args, state, control, **kwargs: Any):
        self._stepped = False

    def on_pre_optimizer_step(self, args, state, control, **kwargs: Any):
        self.trainer.safe_run.hooks_ran.ran("on_pre_optimizer_step")
        if not self._dropping():
            self._verify_once("pre_optimizer_step")

    def on_step_end(self, args, state, control, **kwargs: Any):
        if self._dropping():  # a poisoned step's batches were not trained: its hooks are checked at the next step
            return
        self._verify_once("pre_optimizer_step")  # not yet when `on_pre_optimizer_step` did not fire
        self._verify_once("step_end")
        self._stepped = True

    def on_step_begin(self, args, state, control, **kwargs: Any):
        if self._stepped:
            self._verify_once("next_step")

    def on_train_end(self, args, state, control, **kwargs: Any):
        if self._stepped:
            self._verify_once("next_step")

    def on_save(self, args, state, control, **kwargs: Any):
        verify_hooks(self.trainer, "save", state.global_step)  # the checkpoint's step (`state` as it was saved)

    def _dropping(self) -> bool:
        progress = self.trainer.safe_run.progress
        return progress is not None and progress.dropping

    def _verify_once(self, check: Check) -> None:
        if check not in self.trainer.safe_run.hooks_ran.checked:
            verify_hooks(self.trainer, check)


def verify_hooks(trainer: Any, check: Check, step: int | None = None) -> None:
    """Raise [`UpstreamHookError`] when a hook of `check` did not run in `trainer` (a safe trainer with the guard on);
    record the check as passed otherwise. `step`: the step checked (default: the trainer's `global_step`)."""
    step = trainer.state.global_step if step is None else step
    hooks = trainer.safe_run.hooks_ran
    rows = [row for row in CHECKED if row.check == check]
    owners = {row.owner for row in rows if _applies(trainer, row.owner)}
    attributes = {row.name for row in rows if row.kind == "attribute" and hasattr(trainer, row.name)}
    holds = {name for name, condition in CONDITIONS.items() if condition(trainer, step)}
    missing = unran_hooks(rows, check, hooks.steps, attributes, owners, holds, step)
    if missing:
        message = hook_error_message(missing, check, current_versions_note())
        raise UpstreamHookError(message, [row.label for row in missing])
    hooks.checked.add(check)


def _wrote_checkpoint(hooks: HooksRan, step: int) -> bool:
    return hooks.steps.get("_save_checkpoint") == step and hooks.refused_save != step


def _applies(trainer: Any, owner: str) -> bool:
    """Whether the rows of `owner` apply to `trainer`: those of a trainer class only to its instances (GRPO's hooks
    to GRPO), the others (the Trainer's callback events) to every trainer."""
    cls = resolve_owner(owner)
    if isinstance(cls, type) and issubclass(cls, resolve_owner("transformers:Trainer")):
        return isinstance(trainer, cls)
    return cls is not None


__all__ = ["CHECKED", "HookCheckCallback", "HooksRan", "hook_error_message", "unran_hooks", "verify_hooks"]
