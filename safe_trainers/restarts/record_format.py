"""The step record's shape on disk (`progress.py`): which fields a record holds and of which types, so that a file
this product did not write, or wrote cut short, reads as no record rather than as a wrong one."""

from __future__ import annotations

from typing import Any, Literal, get_args

Phase = Literal["step", "compile", "between", "finished"]

_INT, _OPTIONAL_INT, _SECONDS = (int,), (int, type(None)), (int, float)
# The fields of a record: field -> the types read (absent fields of an older version take their default).
RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "attempt": _INT, "step": _INT, "phase": (str,), "data": (str,), "restart": _INT, "stage": _INT,
    "origin": (str, type(None)), "result": (dict, type(None)), "deaths": (list,), "poisoned": (list,),
    "checkpoints": (list,), "launch": (str, list), "time": _SECONDS, "step_seconds": _SECONDS,
    "began": (int, float, type(None)), "first_step": _INT, "spans": (list,),
}  # fmt: skip
REQUIRED = ("attempt", "step", "phase", "data")


def record_problem(raw: Any) -> str | None:
    """Why a parsed step record cannot be read (wrong shape or types: not written by this product), or `None`."""
    if not isinstance(raw, dict):
        return f"a JSON `{type(raw).__name__}`, not an object"
    missing = [key for key in REQUIRED if key not in raw]
    wrong = [k for k, types in RECORD_TYPES.items() if k in raw and (type(raw[k]) not in types)]
    if missing or wrong:
        return f"`{(missing or wrong)[0]}` is missing or of the wrong type"
    if raw["phase"] not in get_args(Phase):
        return f"`phase` is {raw['phase'][:40]!r}"
    items = [
        all(isinstance(d, dict) and _typed(d, attempt=_INT, step=_OPTIONAL_INT) for d in raw.get("deaths", [])),
        all(isinstance(p, dict) and _typed(p, step=_INT, attempts=(list,)) and _ints(p["attempts"])
            for p in raw.get("poisoned", [])),
        _ints(raw.get("checkpoints", [])),
        isinstance(raw.get("launch", ""), str) or all(isinstance(x, str) for x in raw["launch"]),
        all(isinstance(x, dict) and _has(x, SPAN_TYPES) for x in raw.get("spans", [])),
    ]  # fmt: skip
    if not all(items):
        return "`deaths`, `poisoned`, `checkpoints`, `launch` or `spans` hold values of the wrong type"
    return None


# A span's fields (`progress.Span`). A span may hold more (a newer version's): they are ignored, so that a newer
# version's record still resumes the run.
SPAN_TYPES = dict(
    attempt=_INT, began=_SECONDS, ended=_SECONDS, first_step=_INT, last_step=_INT, step_seconds=_SECONDS,
    finished=(bool,),
)  # fmt: skip


def _has(value: dict, types: dict[str, tuple[type, ...]]) -> bool:
    return all(key in value and type(value[key]) in kinds for key, kinds in types.items())


def _typed(value: dict, **types: tuple[type, ...]) -> bool:
    return set(value) == set(types) and all(type(value[k]) in t for k, t in types.items())


def _ints(values: list) -> bool:
    return all(type(v) is int for v in values)


__all__ = ["Phase", "RECORD_TYPES", "REQUIRED", "SPAN_TYPES", "record_problem"]
