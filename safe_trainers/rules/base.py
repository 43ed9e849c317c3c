"""The `Rule` contract: stable id, what it applies to, and pure checks that return a `Finding` or `None`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..kinds import TRAINER_KINDS
from .report import Change, Finding


ALL_TRAINERS = frozenset(TRAINER_KINDS)


@dataclass(frozen=True)
class BuiltTrainer:
    """Read-only view of a constructed trainer, for the rules that need the loaded model or the tokenized data.

    Args:
        kind (`str`): the trainer kind.
        args (`TrainingArguments`): the trainer's config.
        model (`PreTrainedModel | PeftModel`): the model being trained, after PEFT wrapping.
        train_dataset (`Dataset | IterableDataset | None`): the training dataset after TRL's tokenization.
        peft_config (`PeftConfig | None`): the PEFT config the trainer used.
        source_rows (`int | None`): the number of rows of the training dataset as passed, before TRL's preprocessing.
        processing_class (`PreTrainedTokenizerBase | ProcessorMixin | None`): the tokenizer or processor TRL uses.
        ref_model (`PreTrainedModel | None`): the reference model TRL built or was given (DPO, KTO, GRPO with `beta`).
        snapshot_strategy (`str | None`): how the run spreads its state over ranks, as the NaN guard's snapshot sees
            it (`"single"`, `"ddp"`, `"fsdp2"`, `"zero1"`..`"zero3"`).
        snapshot_bytes_per_node (`int | None`): host bytes the guard's snapshots of one node's ranks would hold.
        host_memory_available (`int | None`): host memory available when the trainer was built, in bytes.
        save_copy_bytes (`int | None`): host bytes a background save's copy of the state would hold (the weights
            `save_pretrained` writes and the optimizer's moments; one process or DDP's rank 0, `None` otherwise).
    """

    kind: str
    args: Any
    model: Any
    train_dataset: Any = None
    peft_config: Any = None
    source_rows: int | None = None
    processing_class: Any = None
    ref_model: Any = None
    snapshot_strategy: str | None = None
    snapshot_bytes_per_node: int | None = None
    host_memory_available: int | None = None
    save_copy_bytes: int | None = None


class Rule:
    """A named safety rule.

    Subclasses set the class attributes and override `check` (runs on a [`TrainerSetup`] before the model is loaded),
    `check_built` (runs on a [`BuiltTrainer`] after construction), or both. Checks are pure: they read and return a
    [`Finding`] (or `None`). The stages act on it: before construction the changes are applied from their paths
    (`rules/apply.py`); after it, by the rule's own `apply_built` (overridden by every rule whose `check_built` fixes).

    Attributes:
        id (`str`): stable id used in reports and in `safety_disable_rules`. Never renamed once released.
        summary (`str`): one line for the README table and `safe-trainers rules`.
        trainers (`frozenset[str]`): trainer kinds the rule applies to.
        rationale (`str`): the upstream issue or document that justifies the rule.
    """

    id: ClassVar[str]
    summary: ClassVar[str]
    trainers: ClassVar[frozenset[str]] = ALL_TRAINERS
    rationale: ClassVar[str] = ""

    def check(self, setup: Any) -> Finding | None:
        return None

    def check_built(self, built: BuiltTrainer) -> Finding | None:
        return None

    def apply_built(self, trainer: Any, finding: Finding) -> None:
        """Carry out a fix that `check_built` returned on the built trainer, in place (an action: the built stage calls
        it for each fix it applies). `finding.data` holds what the check found (rows to drop, parameter names)."""
        raise NotImplementedError(f"`{self.id}` fixed the built trainer in `check_built` but has no `apply_built`.")

    # Helpers so that rules read like the reports they produce.
    def fixed(self, message: str, *changes: Change, **data: Any) -> Finding:
        """A fix; changes that leave a value as it was are dropped, so the report lists only real changes."""
        return Finding(self.id, "fixed", message, tuple(c for c in changes if c.old != c.new), data)

    def warned(self, message: str, **data: Any) -> Finding:
        return Finding(self.id, "warned", message, (), data)

    def blocked(self, message: str, **data: Any) -> Finding:
        return Finding(self.id, "blocked", message, (), data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r})"
