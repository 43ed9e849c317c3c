"""The README restates the code: every rule documented, every catalogued NaN source mapped to a rule or to the guard
(with the right count), which rule runs for which trainer, and the tests cited for each deliberate difference."""

from __future__ import annotations

import os
import re
from pathlib import Path

from safe_trainers.kinds import TRAINER_KINDS
from safe_trainers.openrlhf import rule_ids as shim_rule_ids
from safe_trainers.rules import DEFAULT_RULES, rule_ids

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def section(title: str) -> str:
    with open(README) as f:
        text = f.read()
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start:end]


def table_rows(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def test_every_rule_has_a_row_in_the_rules_table():
    rows = table_rows(section("## The rules"))
    documented = {row[0].strip("`") for row in rows if row[0].startswith("`")}
    assert set(rule_ids()) <= documented


def test_every_shim_rule_is_in_the_shim_table():
    documented = {row[0].strip("`") for row in table_rows(section("### 3. OpenRLHF")) if row[0].startswith("`")}
    assert set(shim_rule_ids()) <= documented


def handled_by_a_rule(cell: str) -> bool:
    first = re.match(r"`([a-z0-9_]+\.[a-z0-9_]+)`", cell)
    return bool(first) and first.group(1) in rule_ids()


def test_every_catalogued_source_is_mapped_and_the_count_is_right():
    text = section("### The NaN catalogue, source by source")
    tables = text.split("\n\n")
    defaults = next(table_rows(t) for t in tables if "source (safe_defaults.md section 3)" in t)
    recent = next(table_rows(t) for t in tables if "source (nan_sources_2026.md)" in t)
    assert [row[0] for row in defaults] == [str(i) for i in range(1, 21)]  # the 20 sources of section 3
    assert len(recent) == 14  # the rows of nan_sources_2026.md
    for row in defaults + recent:
        cell = row[-1]
        # a rule id, or the reason it cannot (or need not) be a construction-time rule
        assert handled_by_a_rule(cell) or re.match(r"(the guard|TRL|no rule)", cell), row
    covered = sum(handled_by_a_rule(row[-1]) for row in defaults), sum(handled_by_a_rule(row[-1]) for row in recent)
    stated = re.search(r"Coverage: (\d+) of the 20 .* and (\d+) of the 14 .*: (\d+) of 34 in all", text, re.S)
    assert stated, "the coverage sentence is missing"
    assert (int(stated.group(1)), int(stated.group(2)), int(stated.group(3))) == (*covered, sum(covered))


ROOT = Path(__file__).resolve().parent.parent
README_TEXT = (ROOT / "README.md").read_text()


def table_after(header: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table whose header row starts with `header`."""
    lines = README_TEXT.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_rule_matrix_matches_the_rules():
    header = "| rule | " + " | ".join(TRAINER_KINDS) + " |"
    assert header in README_TEXT
    matrix = {row[0].strip("`"): {k for k, cell in zip(TRAINER_KINDS, row[1:]) if cell} for row in table_after(header)}
    assert matrix == {rule.id: set(rule.trainers) for rule in DEFAULT_RULES}


def test_deliberate_differences_cite_existing_tests():
    rows = table_after("| what differs from TRL |")
    assert len(rows) >= 10
    for what, cause, shown_by in rows:
        assert cause and shown_by, what
        current = None
        for ref in re.findall(r"`([^`]+)`", shown_by):
            path, _, name = ref.partition("::")
            if path.endswith(".py"):
                current = ROOT / "tests" / path
                assert current.is_file(), ref
            else:
                name = path  # a test of the file named before it
            if name:
                assert current is not None and f"def {name}(" in current.read_text(), ref
