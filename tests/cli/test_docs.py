"""The docs restate the code and stay honest: the rules reference is generated and fresh, every rule documents what it
changes, why and how to opt out, the NaN catalogue maps every source to a rule or to the guard, every deliberate
difference cites an existing test, and the README stays a short front page whose links resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from safe_trainers.cli.rules import docstring_sections, render_markdown
from safe_trainers.openrlhf import RULES as SHIM_RULES
from safe_trainers.rules import DEFAULT_RULES, rule_ids


ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def table_rows(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def test_the_rules_reference_is_generated_and_fresh():
    # Regenerate with `safe-trainers rules --format markdown > docs/rules.md`.
    assert (DOCS / "rules.md").read_text() == render_markdown()


@pytest.mark.parametrize("rule", DEFAULT_RULES, ids=lambda r: r.id)
def test_every_trainer_rule_documents_what_why_and_opt_out(rule):
    sections = docstring_sections(rule)
    assert all(sections.get(label) for label in ("", "What it changes", "Why", "Opt out")), sections
    assert rule.id in sections["Opt out"]


@pytest.mark.parametrize("rule", SHIM_RULES, ids=lambda r: r.id)
def test_every_shim_rule_documents_what_it_changes(rule):
    sections = docstring_sections(rule)
    assert sections.get("What it changes in the command") and rule.id in sections.get("Opt out", "")


def handled_by_a_rule(cell: str) -> bool:
    first = re.match(r"`([a-z0-9_]+\.[a-z0-9_]+)`", cell)
    return bool(first) and first.group(1) in rule_ids()


def test_every_catalogued_source_is_mapped_and_the_count_is_right():
    text = (DOCS / "design" / "nan_catalogue.md").read_text()
    tables = text.split("\n\n")
    defaults = next(table_rows(t) for t in tables if "| # | source | public sources | handled by |" in t)
    recent = next(table_rows(t) for t in tables if "| recent source | public sources | handled by |" in t)
    assert [row[0] for row in defaults] == [str(i) for i in range(1, 21)]  # the 20 sources known at design time
    assert len(recent) == 14  # the sources reported since
    for row in defaults + recent:
        cell = row[-1]
        assert handled_by_a_rule(cell) or re.match(r"(the guard|TRL|no rule)", cell), row
        assert row[-2], f"no public source for {row[-3]!r}"
    assert not re.search(r"safe_defaults|nan_sources_2026|research/", text)  # private notes users cannot open
    covered = sum(handled_by_a_rule(row[-1]) for row in defaults), sum(handled_by_a_rule(row[-1]) for row in recent)
    stated = re.search(r"Coverage: (\d+) of the 20 .* and (\d+) of the 14 .*: (\d+) of 34 in all", text, re.S)
    assert stated, "the coverage sentence is missing"
    assert (int(stated.group(1)), int(stated.group(2)), int(stated.group(3))) == (*covered, sum(covered))


def test_deliberate_differences_cite_existing_tests():
    text = (DOCS / "differences.md").read_text()
    start = text.index("| what differs from TRL |")
    rows = table_rows(text[start:].split("\n\n")[0])
    assert len(rows) >= 10
    test_files = {path.name: path for path in (ROOT / "tests").rglob("test_*.py")}
    for what, cause, shown_by in rows:
        assert cause and shown_by, what
        current = None
        for ref in re.findall(r"`([^`]+)`", shown_by):
            path, _, name = ref.partition("::")
            if path.endswith(".py"):
                current = test_files.get(Path(path).name)
                assert current is not None, ref
            else:
                name = path  # a test of the file named before it
            if name:
                assert current is not None and f"def {name}(" in current.read_text(), ref


def test_the_readme_is_a_short_front_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(((?:docs/)[^)#]*)\)", readme)
    assert links and all((ROOT / link).exists() for link in links), links
    for page in DOCS.rglob("*.md"):
        for link in re.findall(r"\]\(([a-z_/]+\.md)\)", page.read_text()):
            assert (page.parent / link).exists(), (page, link)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page (lower case, punctuation dropped, spaces to `-`)."""
    headings = re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_to_a_section_resolve_and_settings_points_to_the_rule_matrix():
    settings = (DOCS / "settings.md").read_text()
    # It promised "the matrix below the table" with neither below it: the matrix is generated into rules.md.
    assert "below the table" not in settings
    assert "(rules.md#which-rule-runs-for-which-trainer)" in settings
    pages = [ROOT / "README.md", *DOCS.rglob("*.md")]
    links = [(page, target, anchor) for page in pages
             for target, anchor in re.findall(r"\]\(([\w/.\-]*\.md)?#([\w\-]+)\)", page.read_text())]  # fmt: skip
    assert len(links) > 20
    for page, target, anchor in links:
        text = (page.parent / target if target else page).read_text()
        assert anchor in heading_anchors(text), (page, target, anchor)
