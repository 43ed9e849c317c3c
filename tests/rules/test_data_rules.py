"""`data.no_loss_tokens`: rows with no token to train on (completion cut by `max_length`, masked labels), counted from
the tokenized dataset."""

from __future__ import annotations

import pytest
from datasets import Dataset

from safe_trainers import SafetyError
from safe_trainers.rules import BuiltTrainer, get_rule
from safe_trainers.rules.data import kept_completion_tokens, rows_without_loss_tokens, token_counts
from safe_trainers.rules.engine import new_report, run_stage
from safe_trainers.rules.report import Change

from rule_utils import make_args, settings  # tests/ is on sys.path, as for conftest
from trainer_utils import actions, read_report, train_losses  # tests/ is on sys.path, as for conftest
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.toy import dataset_for
import math


KTO = get_rule("kto.batch_and_labels")


# --------------------------------------------------------------------------------------------------------------------
# data.no_loss_tokens
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_len, completion_len, max_length, mode, kept",
    [
        (5, 3, None, "keep_start", 3),
        (5, 3, 8, "keep_start", 3),
        (5, 3, 100, "keep_start", 3),
        (5, 3, 6, "keep_start", 1),
        (5, 3, 5, "keep_start", 0),
        (10, 3, 8, "keep_start", 0),
        (0, 3, 2, "keep_start", 2),
        (5, 0, 8, "keep_start", 0),
        (10, 3, 8, "keep_end", 3),
        (10, 12, 8, "keep_end", 8),
        (5, 0, 8, "keep_end", 0),
        (5, 3, None, "keep_end", 3),
    ],
)
def test_kept_completion_tokens(prompt_len, completion_len, max_length, mode, kept):
    assert kept_completion_tokens(prompt_len, completion_len, max_length, mode) == kept


def test_rows_without_loss_tokens():
    dpo = {"prompt_ids": [4, 10, 3, 2], "chosen_ids": [3, 3, 0, 2], "rejected_ids": [3, 3, 2, 2]}
    assert rows_without_loss_tokens("dpo", dpo, 8, "keep_start") == [1, 2]
    assert rows_without_loss_tokens("dpo", dpo, 8, "keep_end") == [2]
    assert rows_without_loss_tokens("dpo", dpo, None, "keep_start") == [2]
    assert rows_without_loss_tokens("dpo", dpo, 100, "keep_start") == [2]
    kto = {"prompt_ids": [4, 8, 2], "completion_ids": [2, 2, 0]}
    # KTO's collator always keeps the start, whatever `truncation_mode` says
    assert rows_without_loss_tokens("kto", kto, 8, "keep_start") == [1, 2]
    reward = {"chosen_ids": [3, 0, 2, 4], "rejected_ids": [2, 2, 0, 4]}
    assert rows_without_loss_tokens("reward", reward, 8, "keep_start") == [1, 2]
    assert rows_without_loss_tokens("reward", {"chosen_ids": [1], "rejected_ids": [1]}, None, "keep_start") == []


def _tokenized_dpo(prompt_lens, completion_len=3):
    n = len(prompt_lens)
    return Dataset.from_dict(
        {
            "prompt_ids": [[7] * p for p in prompt_lens],
            "chosen_ids": [[8] * completion_len] * n,
            "rejected_ids": [[9] * completion_len] * n,
        }
    )


def test_token_counts_reads_arrow_lengths():
    data = _tokenized_dpo([1, 4, 0])
    assert token_counts(data, ("prompt_ids", "chosen_ids")) == {"prompt_ids": [1, 4, 0], "chosen_ids": [3, 3, 3]}
    assert token_counts(data, ("completion_ids",)) is None
    assert token_counts(None, ("prompt_ids",)) is None


def test_no_loss_tokens_check_built():
    rule = get_rule("data.no_loss_tokens")
    args = make_args("dpo", max_length=8)
    finding = rule.check_built(BuiltTrainer("dpo", args, None, train_dataset=_tokenized_dpo([2, 8, 3, 9, 1])))
    assert finding.action == "fixed"
    assert finding.changes == (Change("train_dataset.num_rows", 5, 3),)
    assert finding.data["drop_rows"] == [1, 3]
    assert "2 of 5 training examples" in finding.message and "`max_length=8`" in finding.message

    finding = rule.check_built(BuiltTrainer("dpo", args, None, train_dataset=_tokenized_dpo([8, 9])))
    assert finding.action == "blocked" and "all 2 training examples" in finding.message

    assert rule.check_built(BuiltTrainer("dpo", args, None, train_dataset=_tokenized_dpo([1, 2]))) is None
    keep_end = make_args("dpo", max_length=8, truncation_mode="keep_end")
    assert rule.check_built(BuiltTrainer("dpo", keep_end, None, train_dataset=_tokenized_dpo([8, 9]))) is None
    # an untokenized dataset (no `*_ids` columns) is not checked
    raw = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    assert rule.check_built(BuiltTrainer("dpo", args, None, train_dataset=raw)) is None


def test_no_loss_tokens_blocked_raises_through_engine():
    rule = get_rule("data.no_loss_tokens")
    built = BuiltTrainer(
        "kto",
        make_args("kto", max_length=4),
        None,
        train_dataset=Dataset.from_dict({"prompt_ids": [[1] * 4], "completion_ids": [[2]]}),
    )
    s = settings()
    with pytest.raises(SafetyError, match=r"\[data.no_loss_tokens\] all 1 training examples"):
        run_stage(built, [rule], s.safety_mode, new_report("kto", s), check=lambda r, b: r.check_built(b), apply=lambda b, f: b)


# --------------------------------------------------------------------------------------------------------------------
# On a real safe trainer, built (and where the claim needs it, trained) from a tiny model
# --------------------------------------------------------------------------------------------------------------------


def _pretokenized_reward_rows(n=8, empty_chosen=(), empty_rejected=()):
    rows = [{"chosen_ids": [5, 6, 7, 1], "rejected_ids": [5, 8, 9, 1]} for _ in range(n)]
    for i in empty_chosen:
        rows[i]["chosen_ids"] = []
    for i in empty_rejected:
        rows[i]["rejected_ids"] = []
    return Dataset.from_list(rows)


def test_reward_rows_without_tokens_dropped_and_counted(toy_models, tmp_path):
    data = _pretokenized_reward_rows(8, empty_chosen=(1, 4), empty_rejected=(6,))
    trainer = build_trainer("reward", toy_models["qwen2-rm"], tmp_path, dataset=data)
    assert len(trainer.train_dataset) == 5
    assert all(len(row["chosen_ids"]) and len(row["rejected_ids"]) for row in trainer.train_dataset)
    (finding,) = trainer.safety_report.by_rule("data.no_loss_tokens")
    assert finding.action == "fixed" and "3 of 8 training examples" in finding.message
    assert [(c.path, c.old, c.new) for c in finding.changes] == [("train_dataset.num_rows", 8, 5)]
    saved = [f for f in read_report(trainer)["findings"] if f["rule_id"] == "data.no_loss_tokens"]
    assert saved[0]["changes"] == [{"path": "train_dataset.num_rows", "old": 8, "new": 5}]
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_reward_all_rows_without_tokens_refused(toy_models, tmp_path):
    data = _pretokenized_reward_rows(4, empty_chosen=(0, 1, 2, 3))
    with pytest.raises(SafetyError, match=r"\[data.no_loss_tokens\] all 4 training examples have no completion token"):
        build_trainer("reward", toy_models["qwen2-rm"], tmp_path, dataset=data)


def _dpo_with_long_prompts(n=8, long=(0, 1, 2)):
    rows = dataset_for("dpo", n).to_list()
    for i in long:
        rows[i]["prompt"] = " ".join(["one two three four five six seven eight nine ten"] * 4)
    return Dataset.from_list(rows)


def test_dpo_prompts_filling_max_length_rows_dropped_and_training_runs(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, dataset=_dpo_with_long_prompts(), max_length=16)
    assert len(trainer.train_dataset) == 5
    assert all(len(row["prompt_ids"]) < 16 for row in trainer.train_dataset)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_dpo_prompts_filling_max_length_counted_in_report(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, dataset=_dpo_with_long_prompts(), max_length=16)
    assert len(trainer.train_dataset) == 5  # three rows were dropped ...
    findings = trainer.safety_report.by_rule("data.no_loss_tokens")
    assert findings, "... but the report does not say so"
    assert "3 of 8 training examples" in findings[0].message


def test_dpo_all_prompts_filling_max_length_refused(toy_models, tmp_path):
    data = _dpo_with_long_prompts(4, long=(0, 1, 2, 3))
    with pytest.raises(SafetyError, match=r"\[data.no_loss_tokens\] all 4 training examples"):
        build_trainer("dpo", toy_models["qwen2"], tmp_path, dataset=data, max_length=16)


def test_dpo_keep_end_keeps_long_prompts(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        dataset=_dpo_with_long_prompts(),
        max_length=16,
        truncation_mode="keep_end",
    )
    assert len(trainer.train_dataset) == 8
    assert "data.no_loss_tokens" not in actions(trainer)
