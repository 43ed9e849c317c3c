"""A fresh install reproduces what CI tested: CI runs the README's test command, and `constraints.txt` pins every
dependency to one version inside the range `pyproject.toml` supports."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


ROOT = Path(__file__).resolve().parent.parent


def pinned_versions() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier  # exactly one `==` each
        assert specifier.operator == "==", line
        pins[canonicalize_name(requirement.name)] = Version(specifier.version)
    return pins


def declared_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return [Requirement(r) for r in project["dependencies"] + extras]


def test_constraints_pin_every_dependency_inside_its_supported_range():
    pins = pinned_versions()
    for requirement in declared_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"`{requirement.name}` is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (requirement, pins[name])


def test_ci_runs_the_readme_test_command_with_the_constraints():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(pip install [^\n]+)\n```", readme)
    test_command = next(c for c in commands if "pytest" in c)
    assert "-c constraints.txt" in test_command and "torch==2.13.0" in test_command
    assert all("-c constraints.txt" in c for c in commands), commands  # the demo command too
    assert test_command in (ROOT / ".ci" / "run").read_text()
