"""The upstream names safe_trainers depends on (`safe_trainers/upstream/`): they exist in the installed versions, a
missing one is an `ImportError` that names it with the versions, and `docs/design/upstream.md` lists exactly the
table's rows, each with tests that exist, while the package's source touches no private upstream name the table
lacks (nor does the table keep a name the source no longer touches)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
import transformers

from safe_trainers.trainer import replay
from safe_trainers.upstream import TOUCHPOINTS, Touchpoint
from safe_trainers.upstream.doc import render_markdown
from safe_trainers.upstream.names import import_error_message, missing_names, require_upstream_names, resolve_owner
from safe_trainers.upstream.versions import parse_requirement, supported_ranges, versions_note


ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "safe_trainers"


def test_the_installed_versions_have_every_name():
    assert missing_names(TOUCHPOINTS, resolve_owner) == []
    assert sum(row.at_import for row in TOUCHPOINTS) >= 20  # the methods and helpers are all looked up


def test_a_missing_name_is_an_import_error_naming_the_versions():
    # An old `Trainer` as the import check sees it: neither `_get_grad_norm` (5.3) nor `get_batch_samples` (4.47).
    old_trainer = type("Trainer", (), {"_save_checkpoint": lambda self: None})
    fakes = {"transformers:Trainer": old_trainer}
    rows = [r for r in TOUCHPOINTS if r.name in ("_get_grad_norm", "_save_checkpoint", "get_batch_samples")]
    missing = missing_names(rows, lambda owner: fakes.get(owner, resolve_owner(owner)))
    assert [row.label for row in missing] == [
        "transformers.Trainer._get_grad_norm",
        "transformers.Trainer.get_batch_samples",
    ]
    note = versions_note({"transformers": "5.1.0", "trl": "1.16.0"}, {"transformers": ">=5.3,<6", "trl": ">=1.16"})
    message = import_error_message(missing, note)
    assert "`transformers.Trainer._get_grad_norm` (added in transformers 5.3.0)" in message
    assert (
        "`transformers.Trainer.get_batch_samples` (added in transformers between 4.46 and 4.47) are missing" in message
    )
    assert "Installed: transformers 5.1.0, trl 1.16.0; supported by safe-trainers: transformers>=5.3,<6" in message
    # The edge: a name the installed transformers lacks, with the versions read from the package metadata.
    absent = Touchpoint("transformers:Trainer", "_no_such_hook", "method", "overrides", "9.0.0", "-", "-", ())
    expected = r"`transformers\.Trainer\._no_such_hook` \(added in transformers 9\.0\.0\)"
    with pytest.raises(ImportError, match=expected) as caught:
        require_upstream_names([absent])
    assert f"transformers {metadata.version('transformers')}" in str(caught.value)
    assert f"transformers{supported_ranges()['transformers']}" in str(caught.value)
    require_upstream_names()  # the real table, in this environment


def test_requirements_are_read_as_ranges():
    assert parse_requirement("transformers<6,>=5.3") == ("transformers", ">=5.3,<6")
    assert parse_requirement('deepspeed<0.20,>=0.18; extra == "deepspeed"') == ("deepspeed", ">=0.18,<0.20")
    assert parse_requirement("peft[extra] (>=0.18, <0.22)") == ("peft", ">=0.18,<0.22")
    assert parse_requirement("pyyaml") == ("pyyaml", "")
    declared = dict(parse_requirement(r) for r in metadata.requires("safe-trainers"))
    assert supported_ranges(["trl", "deepspeed"]) == {"trl": declared["trl"], "deepspeed": declared["deepspeed"]}


def test_the_touchpoint_table_in_the_docs_is_generated_and_fresh():
    # Regenerate with `python -m safe_trainers.upstream.doc docs/design/upstream.md`.
    assert render_markdown() in (ROOT / "docs" / "design" / "upstream.md").read_text()


@pytest.mark.parametrize("row", TOUCHPOINTS, ids=lambda row: row.label)
def test_every_touchpoint_cites_tests_that_exist_and_the_modules_that_touch_it(row):
    assert row.tests and row.purpose and row.since
    for test in row.tests:
        path, _, name = test.partition("::")
        assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), test
    for where in row.where.split(","):
        source = (PACKAGE / where.strip()).read_text()
        assert re.search(rf"\b{re.escape(row.name)}\b", source), (row.label, where)


# Private names a module may use without a row: the standard library's.
STANDARD = {"_replace", "_asdict", "_fields", "_exit"}  # namedtuples, `os._exit`
# Upstream classes a package class replaces a private name of without calling `super()` (`LintDevices._setup_devices`
# for the config's cached device): a name the package declares that one of them has is an override.
REPLACED_IN = (transformers.TrainingArguments, transformers.TrainerCallback)


def private_names(text: str) -> tuple[set[str], set[str], set[str]]:
    """The private names a module touches on other objects, those it declares itself, and those it overrides (a
    `super()` call names the upstream method)."""
    used = set(re.findall(r"\w\.(_[a-z]\w*)", text))
    used |= set(re.findall(r"(?:getattr|hasattr|setattr)\([^,()]+,\s*[\"'](_[a-z]\w*)[\"']", text))
    declared = set(re.findall(r"^\s*def (_\w+)", text, re.M))
    declared |= set(re.findall(r"^(?:    )?(_\w+)\s*[:=]", text, re.M))  # module and class level
    declared |= set(re.findall(r"self\.(_[a-z]\w*)\s*:[^=\n]+=", text))  # annotated: `self._x: T = ...`
    for init in re.findall(r"def __init__\(\s*self.*?(?=\n    def |\nclass |\Z)", text, re.S):
        declared |= set(re.findall(r"self\.(_[a-z]\w*)\s*=", init))
    declared |= set(re.findall(r"import .*?\b(_[a-z]\w*)", text))
    return used, declared, set(re.findall(r"super\(\)\.(_[a-z]\w*)", text))


def test_every_private_upstream_name_the_package_touches_has_a_row():
    used, declared, overridden = set(replay._REPLAY_SENSITIVE), set(), set()
    for path in PACKAGE.rglob("*.py"):
        module_used, module_declared, module_overridden = private_names(path.read_text())
        used |= module_used
        declared |= module_declared
        overridden |= module_overridden
    overridden |= {n for n in declared if not n.startswith("__") and any(hasattr(cls, n) for cls in REPLACED_IN)}
    touched = (used - declared - STANDARD) | overridden
    rows = {row.name for row in TOUCHPOINTS}
    assert sorted(touched - rows) == []
    assert sorted({name for name in rows if name.startswith("_")} - touched) == []  # no stale row
