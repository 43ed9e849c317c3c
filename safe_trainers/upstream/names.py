"""The names safe_trainers needs from transformers, TRL, torch and PEFT exist, or a clear `ImportError`.

Run when the trainers are imported (`safe_trainers/trainers.py`, before any module that imports those names), so an
environment outside the supported ranges fails with the missing names, the installed versions and the supported
ranges instead of an `AttributeError` in the middle of a run. Every module it looks in is already imported by then:
the check costs a few `getattr`s.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from .table import TOUCHPOINTS
from .touchpoint import Touchpoint
from .versions import current_versions_note


def resolve_owner(owner: str) -> Any | None:
    """The object an owner names (`"transformers:Trainer"`, `"transformers.trainer_utils"`), or `None`."""
    module_name, _, path = owner.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    for part in filter(None, path.split(".")):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def missing_names(rows: Iterable[Touchpoint], resolve: Callable[[str], Any | None]) -> list[Touchpoint]:
    """The rows verified at import (`row.at_import`) whose owner `resolve` cannot find or lacks the name."""
    missing = []
    for row in rows:
        if row.at_import:
            owner = resolve(row.owner)
            if owner is None or not hasattr(owner, row.name):
                missing.append(row)
    return missing


def import_error_message(missing: list[Touchpoint], versions_note: str) -> str:
    """The `ImportError` message for `missing` rows (see [`require_upstream_names`])."""
    names = ", ".join(f"`{row.label}` ({row.added})" for row in missing)
    verb = "is" if len(missing) == 1 else "are"
    return (
        f"safe_trainers cannot hook into the installed libraries: {names} {verb} missing. {versions_note} Install "
        "versions in the supported ranges (`pip install safe-trainers` resolves them; `constraints.txt` pins the "
        "tested set). docs/design/upstream.md lists every upstream name safe_trainers depends on."
    )


def require_upstream_names(rows: Iterable[Touchpoint] = TOUCHPOINTS) -> None:
    """Raise an `ImportError` naming the missing names, the installed versions and the supported ranges."""
    missing = missing_names(rows, resolve_owner)
    if missing:
        raise ImportError(import_error_message(missing, current_versions_note()))


__all__ = ["import_error_message", "missing_names", "require_upstream_names", "resolve_owner"]
