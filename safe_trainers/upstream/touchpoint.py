"""`Touchpoint`: one name of transformers, TRL, torch, PEFT or DeepSpeed that safe_trainers overrides, calls or reads.

A row says what the package does with the name, where, since which upstream release the name exists, how it is
checked (when the trainers are imported, and while training for the hooks the NaN guard depends on) and which tests
fail when upstream changes it. The rows themselves are in `table.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


Kind = Literal["method", "function", "variable", "attribute"]
# When the NaN guard verifies, while training, that the hook ran (see `safe_trainers/trainer/hooks_ran.py`):
#   "pre_optimizer_step": before the first optimizer step of a `train()` call is applied;
#   "step_end": at the end of that first step;
#   "next_step": once the first step and what follows it (log, evaluation, save) are over;
#   "save": at every checkpoint save.
Check = Literal["pre_optimizer_step", "step_end", "next_step", "save"]
# The run-time check applies only when this holds (see `CONDITIONS` in `safe_trainers/trainer/hooks_ran.py`).
Condition = Literal["resumed", "vllm", "saved"]
CHECK_TEXT: dict[str, str] = {
    "pre_optimizer_step": "before the first update",
    "step_end": "at the end of the first step",
    "next_step": "after the first step's log and save",
    "save": "at every save",
}
CONDITION_TEXT: dict[str, str] = {
    "resumed": "when resuming",
    "vllm": "with vLLM",
    "saved": "when the guard's save wrote the checkpoint",
}

# The packages whose names are verified when the trainers are imported: always installed and already imported by
# then (PEFT too); DeepSpeed is optional and costly to import.
IMPORT_CHECKED = ("transformers", "trl", "torch", "peft")


@dataclass(frozen=True)
class Touchpoint:
    """One upstream name the package depends on.

    Args:
        owner (`str`): where the name lives: `"module:Class"` (e.g. `"transformers:Trainer"`) or a module
            (`"transformers.trainer_utils"`). Instance attributes may name a family (`"trl:*Trainer"`: the six).
        name (`str`): the method, attribute or function, e.g. `"_get_grad_norm"`.
        kind (`str`): `"method"`, `"function"` or `"variable"` (a class or module attribute): verified when the
            trainers are imported; `"attribute"`: an instance attribute, set at run time.
        uses (`str`): what the package does with it: overrides, calls, reads, writes, imports, allows (a name the
            resume's safe unpickler lets a checkpoint construct).
        since (`str`): the upstream release that introduced it, from the wheels' source: `"5.3.0"` (absent in the
            release before), `"4.21-4.30"` (between the two releases checked), `"<=4.0"` (in the oldest checked).
        where (`str`): the package modules that touch it, relative to `safe_trainers/`.
        purpose (`str`): what it is for (read in the error messages and the docs).
        tests (`tuple[str, ...]`): the tests that fail when upstream changes it, as `path::test`.
        check (`str`, *optional*): when the guard verifies at run time that the hook ran (see `Check`).
        when (`str`, *optional*): the run-time check applies only under this condition (see `Condition`); it applies
            only to a trainer that is an instance of the owner class in any case (GRPO's hooks to GRPO).
    """

    owner: str
    name: str
    kind: Kind
    uses: str
    since: str
    where: str
    purpose: str
    tests: tuple[str, ...]
    check: Check | None = None
    when: Condition | None = None

    @property
    def package(self) -> str:
        """The distribution the name belongs to, e.g. `"transformers"`."""
        return self.owner.split(":")[0].split(".")[0]

    @property
    def label(self) -> str:
        """The dotted name as users read it, e.g. `transformers.Trainer._get_grad_norm`."""
        return f"{self.owner.replace(':', '.')}.{self.name}"

    @property
    def added(self) -> str:
        """When upstream added the name, in words: `added in transformers 5.3.0`."""
        if self.since.startswith("<="):
            return f"in {self.package} {self.since[2:]} and earlier"
        first, dash, last = self.since.partition("-")
        if dash:
            return f"added in {self.package} between {first} and {last}"
        return f"added in {self.package} {self.since}"

    @property
    def at_import(self) -> bool:
        """Whether `import safe_trainers.trainers` verifies the name exists (class and module level names only)."""
        return self.kind != "attribute" and self.package in IMPORT_CHECKED and "*" not in self.owner


__all__ = ["CHECK_TEXT", "CONDITION_TEXT", "IMPORT_CHECKED", "Check", "Condition", "Kind", "Touchpoint"]
