"""The installed versions of the packages safe_trainers hooks into, and the ranges it declares for them, read from the
package metadata at run time (so an error message names what is really installed and what `pyproject.toml` really
admits)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from importlib import metadata


DISTRIBUTION = "safe-trainers"
# The packages every message names: the training loop's (transformers, accelerate, torch) and TRL's.
NAMED = ("transformers", "trl", "accelerate", "torch")


def installed_versions(names: Iterable[str] = NAMED) -> dict[str, str | None]:
    """`{package: installed version}`; `None` for a package that is not installed."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def supported_ranges(names: Iterable[str] = NAMED) -> dict[str, str | None]:
    """`{package: the range safe-trainers declares}` (e.g. `">=5.0,<6"`), extras included; `None` when safe-trainers
    is not installed as a distribution (a source checkout on `sys.path`) or declares no range."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        requirements = []
    declared = dict(parse_requirement(text) for text in requirements)
    return {name: declared.get(name) for name in names}


def parse_requirement(text: str) -> tuple[str, str]:
    """`'transformers<6,>=5.0'` or `'deepspeed<0.20,>=0.18; extra == "deepspeed"'` -> `('transformers', '>=5.0,<6')`:
    the name (lower case) and its specifiers, lower bounds first (extras and markers left out)."""
    match = _REQUIREMENT.match(text)
    if match is None:
        return text.strip().lower(), ""
    parts = [p.strip().replace(" ", "") for p in match.group("specs").split(",") if p.strip()]
    return match.group("name").lower(), ",".join(sorted(parts, key=lambda p: not p.startswith(">")))


_REQUIREMENT = re.compile(r"\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*\(?(?P<specs>[^;()]*)")


def versions_note(installed: Mapping[str, str | None], ranges: Mapping[str, str | None]) -> str:
    """One sentence naming the installed versions and the supported ranges, e.g. `Installed: transformers 5.2.0,
    trl 1.16.0, ...; supported by safe-trainers: transformers>=5.3,<6, trl>=1.16,<1.17, ...`."""
    have = ", ".join(f"{name} {version or '(not installed)'}" for name, version in installed.items())
    admitted = ", ".join(f"{name}{spec}" for name, spec in ranges.items() if spec)
    if not admitted:
        return f"Installed: {have} (the supported ranges are unknown: safe-trainers is not installed as a package)."
    return f"Installed: {have}; supported by safe-trainers: {admitted}."


def current_versions_note() -> str:
    """[`versions_note`] for this environment."""
    return versions_note(installed_versions(), supported_ranges())


__all__ = ["NAMED", "current_versions_note", "installed_versions", "parse_requirement", "supported_ranges"]
