"""The README's tables that restate the code: which rule runs for which trainer, and the tests cited as evidence for
each deliberate difference from TRL."""

from __future__ import annotations

import re
from pathlib import Path

from safe_trainers.kinds import TRAINER_KINDS
from safe_trainers.rules import DEFAULT_RULES


ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def table_after(header: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table whose header row starts with `header`."""
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_rule_matrix_matches_the_rules():
    header = "| rule | " + " | ".join(TRAINER_KINDS) + " |"
    assert header in README
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
