"""Safe trainer configs: TRL's configs with the [`SafetyArguments`] fields added.

Drop-in: `from safe_trainers import DPOConfig` instead of `from trl import DPOConfig`; every TRL field keeps its name,
default and CLI flag. A safe config refuses, when it is built, every invalid safety field: the fields' own checks
(`arguments.py`) and those that need the rules or the signal table (an unknown rule id, an unknown signal, below).
"""

from __future__ import annotations

from dataclasses import dataclass

import trl

from .argument_checks import validate_safety_arguments
from .arguments import SafetyArguments
from .errors import SafetyError
from .kinds import get_kind
from .restarts.preemption import parse_signals
from .rules import check_disabled_ids
from .rules.report import Finding
from .rules.grpo import CHECKED_GROUP, GroupSize, group_checked, group_size_problems, group_values


def check_settings(settings: SafetyArguments) -> None:
    """Raise a `ValueError` for a rule id in `safety_disable_rules` that no rule has (listing the valid ids) or a
    signal in `preempt_signals` that is not one (`parse_signals`). The fields' own checks run before, in
    [`SafetyArguments`]."""
    check_disabled_ids(settings.safety_disable_rules)
    parse_signals(settings.preempt_signals)


class SettingChecks:
    """Runs [`check_settings`] on a safe config, after its fields' own checks and before TRL's `__post_init__`."""

    def __post_init__(self):
        check_settings(self)
        super().__post_init__()


class GroupChecks:
    """Runs the `grpo.group_size` rule in the config of a trainer that samples groups of completions (GRPO, RLOO),
    before TRL's own checks, so an invalid group gets one error that names every bad setting and its fix.

    It runs once per config: the config records the group values it checked (`rules.grpo.CHECKED_GROUP`), so neither
    the rule at construction nor a copy a rule makes of the config checks them again, unless one of them changed.
    """

    def __post_init__(self):
        validate_safety_arguments(self)
        check_settings(self)
        if self.safety_mode == "off" or GroupSize.id in self.safety_disable_rules or group_checked(self):
            return super().__post_init__()
        problems = group_size_problems(*group_values(self))
        if problems:
            raise SafetyError([Finding(GroupSize.id, "blocked", " ".join(problems))])
        try:
            super().__post_init__()
        except ValueError as error:
            # TRL derives the generation batch from the world size while validating; if that is what it rejected,
            # answer with the rule's message (every bad setting and its fix), keeping TRL's error as the cause.
            problems = group_size_problems(*group_values(self))
            if problems:
                raise SafetyError([Finding(GroupSize.id, "blocked", " ".join(problems))]) from error
            raise
        # TRL's `__post_init__` accepted the generation batch it derived (it refuses one that does not hold whole
        # groups), so the values as they are now form a valid group.
        setattr(self, CHECKED_GROUP, group_values(self))


@dataclass
class SFTConfig(SafetyArguments, SettingChecks, trl.SFTConfig):
    """[`~trl.SFTConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`)."""


@dataclass
class RewardConfig(SafetyArguments, SettingChecks, trl.RewardConfig):
    """[`~trl.RewardConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`)."""


@dataclass
class DPOConfig(SafetyArguments, SettingChecks, trl.DPOConfig):
    """[`~trl.DPOConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`)."""


@dataclass
class KTOConfig(SafetyArguments, SettingChecks, trl.KTOConfig):
    """[`~trl.KTOConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`)."""


@dataclass
class GRPOConfig(GroupChecks, SafetyArguments, SettingChecks, trl.GRPOConfig):
    """[`~trl.GRPOConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`).

    The `grpo.group_size` rule runs here too (see [`GroupChecks`]).
    """


@dataclass
class RLOOConfig(GroupChecks, SafetyArguments, SettingChecks, trl.RLOOConfig):
    """[`~trl.RLOOConfig`] plus the [`SafetyArguments`] fields (`safety_mode`, `safety_disable_rules`, `nan_*`).

    The `grpo.group_size` rule runs here too (see [`GroupChecks`]).
    """


def config_class(kind: str) -> type:
    """The safe config class of trainer kind `kind` (a key of [`~safe_trainers.kinds.KINDS`]), e.g. `DPOConfig`."""
    return globals()[get_kind(kind).config_name]
