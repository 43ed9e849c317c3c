"""safe_trainers: TRL trainers that refuse unsafe settings and never let a NaN reach the weights.

Change one import line for the whole pipeline, `from trl import ...` -> `from safe_trainers import ...`: the trainers
and configs below are the safe subclasses, and every other public name of `trl` (`ScriptArguments`, `ModelConfig`,
`TrlParser`, `get_peft_config`, `apply_chat_template`, ...) is TRL's own object, imported from `trl` the first time it
is asked for (TRL resolves its names lazily too, so importing `safe_trainers` imports no more of TRL than before).
`trl.experimental` stays TRL's: import it from `trl`.
"""

import importlib.util as _importlib_util
from typing import Any as _Any

import trl as _trl

from .arguments import SafetyArguments
from .configs import DPOConfig, GRPOConfig, KTOConfig, RewardConfig, RLOOConfig, SFTConfig
from .errors import SafetyError, TrainingDivergedError
from .report import Change, Finding, SafetyReport
from .rules import DEFAULT_RULES, Rule, rule_ids
from .trainers import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_RULES",
    "Change",
    "DPOConfig",
    "DPOTrainer",
    "Finding",
    "GRPOConfig",
    "GRPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "Rule",
    "SFTConfig",
    "SFTTrainer",
    "SafetyArguments",
    "SafetyError",
    "SafetyReport",
    "TrainingDivergedError",
    "rule_ids",
]

# TRL's public names (its `__all__`), minus its submodules (`trl.trainer`, `trl.scripts`, ...: `safe_trainers` has
# modules of its own, and `from trl import *` brings the objects, not the modules) and minus the names defined here.
# `find_spec` only looks at the file system, so no TRL module is imported here.
TRL_NAMES: tuple[str, ...] = tuple(
    name
    for name in _trl.__all__
    if name not in __all__ and _importlib_util.find_spec(f"{_trl.__name__}.{name}") is None
)
__all__ += TRL_NAMES


def __getattr__(name: str) -> _Any:
    # Called only for names not defined in this module: forward TRL's public names, as the same objects.
    if name in TRL_NAMES:
        value = getattr(_trl, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(TRL_NAMES))
