"""The preference-loss rules: `kto.batch_and_labels` and `dpo.beta_positive` (a `beta` that divides by zero, learns
nothing, or is not finite)."""

from __future__ import annotations

import math

import pytest
from datasets import Dataset

from safe_trainers import SafetyError
from safe_trainers.rules import get_rule
from safe_trainers.rules.dpo import beta_problem

from rule_utils import kto_data, make_args, make_setup, run_setup_stage  # tests/ is on sys.path, as for conftest
from trainer_utils import actions, train_losses  # tests/ is on sys.path, as for conftest
from safe_trainers.testing.build import build_trainer, preset_args
from safe_trainers.testing.toy import dataset_for
import trl


BETA = get_rule("dpo.beta_positive")
KTO = get_rule("kto.batch_and_labels")


# --------------------------------------------------------------------------------------------------------------------
# kto.batch_and_labels and dpo.beta_positive
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("labels", [[True, False], [True, True], None])
@pytest.mark.parametrize("loss_type", ["kto", None])
def test_kto_rule_blocks_a_batch_of_one_with_the_kl_term(labels, loss_type):
    data = kto_data(labels) if labels is not None else None
    args = make_args("kto", per_device_train_batch_size=1)
    if loss_type is None:
        args.loss_type = None  # TRL's default is "kto"
    finding = KTO.check(make_setup("kto", "qwen2", args=args, train_dataset=data))
    assert finding.action == "blocked"
    assert "`per_device_train_batch_size=1` with `loss_type='kto'`" in finding.message
    assert 'loss_type="apo_zero_unpaired"' in finding.message  # the way out that keeps a batch of 1


@pytest.mark.parametrize(
    "data",
    [
        kto_data([True, False, True]),
        None,
        Dataset.from_dict({"prompt": ["p"], "completion": ["c"]}),  # no label column
        Dataset.from_dict({"prompt": ["p"], "completion": ["c"], "label": [True]}).to_iterable_dataset(),
        # one label kind only: TRL skips the empty side of the loss and averages with `nanmean` (it trains)
        kto_data([True, True, True]),
        kto_data([False, False]),
    ],
)
def test_kto_rule_silent(data):
    assert (
        KTO.check(make_setup("kto", "qwen2", args=make_args("kto", per_device_train_batch_size=2), train_dataset=data))
        is None
    )


@pytest.mark.parametrize("labels", [[True, False], [True, True]])
def test_kto_rule_silent_for_a_batch_of_one_without_the_kl_term(labels):
    # `apo_zero_unpaired` has no KL term, so TRL trains it with a batch of 1 (was a false alarm)
    args = make_args("kto", per_device_train_batch_size=1, loss_type="apo_zero_unpaired")
    assert KTO.check(make_setup("kto", "qwen2", args=args, train_dataset=kto_data(labels))) is None


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize("beta", [math.nan, math.inf, -math.inf])
def test_beta_positive_blocks_non_finite(kind, beta):
    args = make_args(kind)
    args.beta = beta
    finding = BETA.check(make_setup(kind, "qwen2", args=args))
    assert finding.action == "blocked"
    assert f"`beta={beta}`" in finding.message and "Use a positive value" in finding.message


@pytest.mark.parametrize("loss_type", ["ipo", "sppo_hard", ["sigmoid", "ipo"]])
def test_beta_zero_blocked_for_losses_that_divide_by_it(loss_type):
    finding = BETA.check(make_setup("dpo", "qwen2", args=make_args("dpo", beta=0.0, loss_type=loss_type)))
    assert finding.action == "blocked" and "division by zero" in finding.message


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize("beta, fragment", [(0.0, "learns nothing"), (-0.1, "rejected answers")])
def test_beta_zero_or_negative_warned(kind, beta, fragment):
    # TRL trains these (constant loss, or the wrong direction): warned, not refused
    finding = BETA.check(make_setup(kind, "qwen2", args=make_args(kind, beta=beta)))
    assert finding.action == "warned" and fragment in finding.message


@pytest.mark.parametrize("kind", ["dpo", "kto", "reward"])
def test_beta_positive_silent(kind):
    assert BETA.check(make_setup(kind, "qwen2", args=make_args(kind))) is None


@pytest.mark.parametrize("mode", ["fix", "warn", "strict"])
def test_blocked_finding_raises_in_every_mode(mode):
    args = make_args("dpo", beta=0.0, loss_type="ipo")
    with pytest.raises(SafetyError, match=r"\[dpo.beta_positive\] `beta=0.0` with `loss_type='ipo'`"):
        run_setup_stage(make_setup("dpo", "qwen2", args=args), mode=mode)


def test_beta_unused_by_an_sft_only_dpo_loss_is_not_judged():
    assert beta_problem(float("inf"), ["sft"]) is None and beta_problem(0.0, ["sft"]) is None
    assert beta_problem(float("inf"), ["sigmoid", "sft"])[0] == "blocked"  # the sigmoid term does use it


# --------------------------------------------------------------------------------------------------------------------
# On a real safe trainer, built (and where the claim needs it, trained) from a tiny model
# --------------------------------------------------------------------------------------------------------------------


def test_kto_batch_of_one_refused(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\[kto.batch_and_labels\] `per_device_train_batch_size=1`"):
        build_trainer("kto", toy_models["qwen2"], tmp_path, per_device_train_batch_size=1)


@pytest.mark.parametrize("label", [True, False])
def test_kto_single_label_dataset_trains(label, toy_models, tmp_path):
    # only desirable (or only undesirable) examples: TRL skips the empty side and averages with `nanmean`
    data = dataset_for("kto", 8).map(lambda row: {"label": label})
    trainer = build_trainer("kto", toy_models["qwen2"], tmp_path, dataset=data, learning_rate=1e-6)
    assert "kto.batch_and_labels" not in actions(trainer)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_kto_apo_zero_unpaired_batch_of_one_trains(toy_models, tmp_path):
    # no KL term, so nothing needs two examples per micro-batch
    trainer = build_trainer(
        "kto", toy_models["qwen2"], tmp_path, per_device_train_batch_size=1, loss_type="apo_zero_unpaired"
    )
    assert "kto.batch_and_labels" not in actions(trainer)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_kto_batch_and_beta_reported_together(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\(2 problems\)") as exc:
        build_trainer("kto", toy_models["qwen2"], tmp_path, per_device_train_batch_size=1, beta=math.inf)
    assert [f.rule_id for f in exc.value.findings] == ["kto.batch_and_labels", "dpo.beta_positive"]
    assert "`per_device_train_batch_size=1`" in str(exc.value) and "`beta=inf`" in str(exc.value)


def test_dpo_beta_zero_with_ipo_refused(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\[dpo.beta_positive\] `beta=0.0` with `loss_type='ipo'`"):
        build_trainer("dpo", toy_models["qwen2"], tmp_path, beta=0.0, loss_type="ipo")


def test_dpo_beta_zero_with_ipo_crashes_in_trl(toy_models, tmp_path):
    # the control for the refusal above: TRL itself fails with a division by zero on the first step
    trainer = trl.DPOTrainer(
        model=toy_models["qwen2"],
        args=trl.DPOConfig(**preset_args("dpo", tmp_path / "out", beta=0.0, loss_type="ipo")),
        train_dataset=dataset_for("dpo", 4),
    )
    with pytest.raises(ZeroDivisionError):
        trainer.train()


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_beta_zero_warned_and_trains(kind, toy_models, tmp_path):
    trainer = build_trainer(kind, toy_models["qwen2"], tmp_path, beta=0.0)
    assert actions(trainer)["dpo.beta_positive"] == "warned"
    assert trainer.args.beta == 0.0
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_beta_zero_accepted_by_trl(kind, toy_models, tmp_path):
    # the control: TRL itself builds a trainer with beta=0 (no gradient from the preference loss)
    trl_config = {"dpo": trl.DPOConfig, "kto": trl.KTOConfig}[kind]
    trl_trainer = {"dpo": trl.DPOTrainer, "kto": trl.KTOTrainer}[kind]
    args = trl_config(**preset_args(kind, tmp_path / "out", beta=0.0))
    trainer = trl_trainer(model=toy_models["qwen2"], args=args, train_dataset=dataset_for(kind, 4))
    assert trainer.args.beta == 0.0
