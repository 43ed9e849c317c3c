"""The rules are found where their ids say: a rule `ns.name` lives in `safe_trainers/rules/ns.py`."""

from __future__ import annotations

import pytest

from safe_trainers.rules import DEFAULT_RULES


@pytest.mark.parametrize("rule", DEFAULT_RULES, ids=lambda r: r.id)
def test_a_rule_lives_in_the_module_of_its_id_namespace(rule):
    namespace = rule.id.split(".", 1)[0]
    assert type(rule).__module__ == f"safe_trainers.rules.{namespace}"
