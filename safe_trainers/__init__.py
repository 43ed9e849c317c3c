"""safe_trainers: TRL trainers that refuse unsafe settings and never let a NaN reach the weights.

Change one import line for the whole pipeline, `from trl import ...` -> `from safe_trainers import ...`: the trainers
and configs below are the safe subclasses, and every other public name of `trl` (`ScriptArguments`, `ModelConfig`,
`TrlParser`, `get_peft_config`, `apply_chat_template`, ...) is TRL's own object, imported from `trl` the first time it
is asked for. `trl.experimental` stays TRL's: import it from `trl`.

Every name is resolved on first use, as TRL does, so `import safe_trainers` (and the `safe-trainers` command line, and
the OpenRLHF shim, which needs neither torch nor transformers) costs nothing until a trainer or config is asked for.
"""

from __future__ import annotations

import importlib as _importlib
import importlib.util as _importlib_util
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any


__version__ = "0.1.0"

# Public name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    "SafetyArguments": "arguments",
    **dict.fromkeys(("DPOConfig", "GRPOConfig", "KTOConfig", "RLOOConfig", "RewardConfig", "SFTConfig"), "configs"),
    **dict.fromkeys(
        ("DPOTrainer", "GRPOTrainer", "KTOTrainer", "RLOOTrainer", "RewardTrainer", "SFTTrainer"), "trainers"
    ),
    **dict.fromkeys(("SafetyError", "TrainingDivergedError"), "errors"),
    **dict.fromkeys(("Change", "Finding", "SafetyReport"), "rules.report"),
    **dict.fromkeys(("DEFAULT_RULES", "Rule", "rule_ids"), "rules"),
}

if _TYPE_CHECKING:  # for type checkers and IDEs; at run time the names resolve lazily (`__getattr__`)
    from .arguments import SafetyArguments
    from .configs import DPOConfig, GRPOConfig, KTOConfig, RewardConfig, RLOOConfig, SFTConfig
    from .errors import SafetyError, TrainingDivergedError
    from .rules.report import Change, Finding, SafetyReport
    from .rules import DEFAULT_RULES, Rule, rule_ids
    from .trainers import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer


def _trl_names() -> tuple[str, ...]:
    """TRL's public names (its `__all__`), minus its submodules (`trl.trainer`, `trl.scripts`, ...: `from trl import
    *` brings the objects, not the modules) and minus the names defined here. `trl` resolves its names lazily and
    `find_spec` only looks at the file system, so this imports no TRL module beyond `trl` itself."""
    trl = _importlib.import_module("trl")
    return tuple(
        name
        for name in trl.__all__
        if name not in _EXPORTS and _importlib_util.find_spec(f"trl.{name}") is None
    )


_trl_names_cache: tuple[str, ...] | None = None


def __getattr__(name: str) -> _Any:
    # Called only for names not yet in this module's namespace.
    global _trl_names_cache
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name == "TRL_NAMES":
        if _trl_names_cache is None:
            _trl_names_cache = _trl_names()
        return _trl_names_cache
    elif name == "__all__":
        return sorted(_EXPORTS) + list(__getattr__("TRL_NAMES"))
    elif not name.startswith("_") and name in __getattr__("TRL_NAMES"):
        value = getattr(_importlib.import_module("trl"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))
