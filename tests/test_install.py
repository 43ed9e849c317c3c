"""A fresh install reproduces what CI tested, and the declared ranges are the tested ones: CI runs the README's test
command on `constraints.txt` and the two version lanes on `constraints/floor.txt` and `constraints/newest.txt`; every
file pins each dependency inside the range `pyproject.toml` declares, the floor lane pins exactly the declared floors,
each upper bound stops at the newest tested minor, and docs/versions.md and the README restate the same versions."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version


ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "constraints.txt"
LANES = {"floor": ROOT / "constraints" / "floor.txt", "newest": ROOT / "constraints" / "newest.txt"}


def pinned_versions(path: Path = DEFAULT) -> dict[str, Version]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier  # exactly one `==` each
        assert specifier.operator == "==", line
        pins[canonicalize_name(requirement.name)] = Version(specifier.version)
    return pins


def declared_requirements(groups: tuple[str, ...] = ("deepspeed", "timeline", "test")) -> list[Requirement]:
    """`pyproject.toml`'s dependencies and those of the optional `groups`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in groups for r in project["optional-dependencies"][group]]
    return [Requirement(r) for r in project["dependencies"] + extras]


def bound(requirement: Requirement, operator: str) -> Version | None:
    versions = [Version(s.version) for s in requirement.specifier if s.operator == operator]
    return versions[0] if versions else None


@pytest.mark.parametrize("path", [DEFAULT, *LANES.values()], ids=lambda p: p.name)
def test_constraints_pin_every_dependency_inside_its_supported_range(path):
    pins = pinned_versions(path)
    for requirement in declared_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"`{requirement.name}` is not pinned in {path.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (path.name, requirement, pins[name])


def test_the_floor_lane_pins_every_declared_floor():
    floor = pinned_versions(LANES["floor"])
    for requirement in declared_requirements():
        lowest, pinned = bound(requirement, ">="), floor[canonicalize_name(requirement.name)]
        assert lowest is not None and pinned == lowest, (requirement, pinned)


def test_upper_bounds_stop_at_the_newest_tested_minor():
    # The test tools (extra `test`) keep a major bound: they run this suite, not users' training.
    newest = pinned_versions(LANES["newest"])
    for requirement in declared_requirements(groups=("deepspeed", "timeline")):
        tested = newest[canonicalize_name(requirement.name)]
        assert bound(requirement, "<") == Version(f"{tested.major}.{tested.minor + 1}"), (requirement, tested)


def versions_table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "versions.md").read_text()
    start = text.index("| package | declared range |")
    rows = text[start:].split("\n\n")[0].splitlines()[2:]  # after the header and the `|---|` line
    cells = [[cell.strip().strip("`") for cell in row.strip("|").split("|")] for row in rows]
    return {canonicalize_name(row[0].split()[0]): row[1:] for row in cells}  # "deepspeed (extra ...)"


def test_docs_state_the_declared_ranges_and_the_lane_versions():
    table = versions_table()
    files = [LANES["floor"], LANES["newest"], DEFAULT]
    pins = [pinned_versions(path) for path in files]
    assert set(table) == {canonicalize_name(r.name) for r in declared_requirements()}
    for requirement in declared_requirements():
        declared, *stated = table[canonicalize_name(requirement.name)]
        assert SpecifierSet(declared) == requirement.specifier, (declared, requirement)
        lanes = [str(p[canonicalize_name(requirement.name)]) for p in pins]
        assert stated == lanes, (requirement.name, stated, lanes)


def test_the_readme_names_the_tested_span_of_each_dependency():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Supported versions") :]
    floor, newest = pinned_versions(LANES["floor"]), pinned_versions(LANES["newest"])
    text = " ".join(section.split())
    for requirement in declared_requirements(groups=("deepspeed", "timeline")):
        name = canonicalize_name(requirement.name)
        span = f"{floor[name]}" if floor[name] == newest[name] else f"{floor[name]}-{newest[name]}"
        assert re.search(rf"\b{re.escape(requirement.name)} {re.escape(span)}\b", text), (requirement.name, span)


def test_ci_runs_the_readme_test_command_with_the_constraints():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(pip install [^\n]+)\n```", readme)
    test_command = next(c for c in commands if "pytest" in c)
    assert "-c constraints.txt" in test_command and "torch==2.13.0" in test_command
    assert all("-c constraints.txt" in c for c in commands), commands  # the demo command too
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_ci_runs_both_lanes_and_the_readme_command_last():
    run = (ROOT / ".ci" / "run").read_text()
    assert "for lane in floor newest; do" in run and 'bash .ci/lane "$lane"' in run
    lane = (ROOT / ".ci" / "lane").read_text()
    assert '-c "constraints/$lane.txt"' in lane and all(path.exists() for path in LANES.values())
    assert run.rindex("python -m pytest") > run.rindex(".ci/lane")  # pytest's closing lines are the whole suite's


def test_the_lanes_import_in_the_environment_pip_install_resolves_and_beside_each_floor():
    # The floor lane passed with trl 1.14.0, which imports `requests` without declaring it, only because datasets 4.7.0
    # brings `requests`: every lane first imports with nothing but the declared set (no extras), and the newest lane
    # then imports with each declared floor beside the newest releases of the rest.
    lane = (ROOT / ".ci" / "lane").read_text()
    core_install = 'pip install -q -c "constraints/$lane.txt" -e .\nimport_every_public_name'
    assert core_install in lane and lane.index(core_install) < lane.index('-e ".[deepspeed,test]"\npython -m pytest')
    assert 'for pin in $(declared_floors torch); do' in lane and 'pip install -q "$pin" "${back[@]}" safe-trainers' in lane
    assert lane.rstrip().endswith('[ -z "$(lane_versions_changed)" ]\nfi')  # the lane's set is back at the end
    assert "requests" in {canonicalize_name(r.name) for r in declared_requirements(groups=())}
