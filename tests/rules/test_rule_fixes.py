"""Who carries out a fix, and how often a check runs.

A built-time fix is carried out by the rule that found it (`Rule.apply_built`, next to its `check_built`), and the
`grpo.group_size` check runs once per config: in the config the user builds, then only for a config whose group
values changed.
"""

from __future__ import annotations

import pytest

from safe_trainers import SafetyArguments, SafetyError, configs
from safe_trainers.rules import DEFAULT_RULES, Rule, grpo
from safe_trainers.rules.report import Change, SafetyReport
from safe_trainers.rules.stages import run_built_rules
from safe_trainers.testing.build import build_trainer, preset_args
from safe_trainers.testing.toy import dataset_for, rank_reward
from safe_trainers.trainers import trainer_class

from rule_utils import make_setup, run_setup_stage  # tests/ is on sys.path, as for conftest
from trainer_utils import actions

# --------------------------------------------------------------------------------------------------------------------
# A built-time fix lives in its rule
# --------------------------------------------------------------------------------------------------------------------

BUILT_RULES = [rule for rule in DEFAULT_RULES if type(rule).check_built is not Rule.check_built]


@pytest.mark.parametrize("rule", BUILT_RULES, ids=lambda r: r.id)
def test_every_built_time_rule_carries_out_its_own_fix(rule):
    assert type(rule).apply_built is not Rule.apply_built


class DropFirstRow(Rule):
    """A new built-time fix, written in one place: the check and the action that carries it out."""

    id = "test.drop_first_row"
    summary = "Drops the first training row."

    def check_built(self, built):
        rows = len(built.train_dataset)
        return self.fixed("the first row is dropped.", Change("train_dataset.first_row", rows, rows - 1))

    def apply_built(self, trainer, finding):
        trainer.train_dataset = trainer.train_dataset.select(range(1, len(trainer.train_dataset)))


class NoAction(Rule):
    """A built-time fix without the action that carries it out."""

    id = "test.no_action"
    summary = "Fixes nothing it can apply."

    def check_built(self, built):
        return self.fixed("nothing is done.", Change("model.nothing", 0, 1))


def test_a_built_time_fix_is_applied_by_its_rule_and_reported_as_found(toy_models, tmp_path):
    trainer = build_trainer("sft", toy_models["qwen2"], tmp_path)
    rows = len(trainer.train_dataset)
    first = trainer.train_dataset[1]
    report = SafetyReport(trainer="sft", mode="fix")
    run_built_rules(trainer, SafetyArguments(), report, rules=[DropFirstRow()])
    assert len(trainer.train_dataset) == rows - 1 and trainer.train_dataset[0] == first
    assert [(f.rule_id, f.action) for f in report.findings] == [("test.drop_first_row", "fixed")]
    assert report.changes == [Change("train_dataset.first_row", rows, rows - 1)]
    # a rule that fixes the built trainer without saying how is a programming error, named as such
    with pytest.raises(NotImplementedError, match="`test.no_action`.*`apply_built`"):
        run_built_rules(trainer, SafetyArguments(), report, rules=[NoAction()])


# --------------------------------------------------------------------------------------------------------------------
# grpo.group_size runs once per config
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def group_checks(monkeypatch):
    """The group values `grpo.group_size` checks, in order, wherever it runs (the config, or the rule)."""
    checked = []
    problems = grpo.group_size_problems

    def counted(*values):
        checked.append(values)
        return problems(*values)

    for module in (configs, grpo):
        monkeypatch.setattr(module, "group_size_problems", counted)
    return checked


def test_group_check_runs_once_while_a_grpo_trainer_is_built(toy_models, tmp_path, group_checks):
    args = configs.GRPOConfig(**preset_args("grpo", tmp_path, per_device_train_batch_size=2))
    assert len(group_checks) == 1
    trainer = trainer_class("grpo")(
        model=toy_models["qwen2"], reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4)
    )
    assert actions(trainer)["logging.show_nonfinite"] == "fixed" and trainer.args is not args  # a rule copied it
    assert len(group_checks) == 1
    assert actions(trainer).get("grpo.group_size") is None


class Cooler(Rule):
    """Changes a group value: the config it gives is a new group, checked once."""

    id = "test.cooler"
    summary = "Samples at temperature 0.7."
    trainers = frozenset({"grpo", "rloo"})

    def check(self, setup):
        temperature = setup.args.temperature
        return self.fixed("cooler.", Change("args.temperature", temperature, 0.7)) if temperature != 0.7 else None


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_group_check_runs_again_only_for_a_changed_group(kind, group_checks):
    setup = make_setup(kind)
    assert len(group_checks) == 1
    fixed, report = run_setup_stage(setup, rules=[*DEFAULT_RULES, Cooler()])
    assert {"logging.show_nonfinite", "test.cooler"} <= {f.rule_id for f in report.findings if f.action == "fixed"}
    assert fixed.args.temperature == 0.7 and setup.args.temperature == 1.0
    assert [values[2] for values in group_checks] == [1.0, 0.7]  # the user's config, then the cooler copy
    # a value changed after the config checked itself is checked at construction, as before
    setup.args.num_generations = 1
    with pytest.raises(SafetyError, match=r"\[grpo.group_size\] `num_generations=1`"):
        run_setup_stage(setup)
    assert [values[0] for values in group_checks] == [2, 2, 1]
