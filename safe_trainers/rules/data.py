"""Data rule: drop examples left with no loss token after tokenization and truncation (a mean over nothing is NaN)."""

from __future__ import annotations

from .report import Change, Finding
from . import data_sft
from .base import BuiltTrainer, Rule


def kept_completion_tokens(
    prompt_len: int, completion_len: int, max_length: int | None, truncation_mode: str = "keep_start"
) -> int:
    """How many completion tokens survive the collator's truncation of `prompt + completion` to `max_length`."""
    if max_length is None:
        return completion_len
    if truncation_mode == "keep_end":
        return min(completion_len, max_length)
    return max(0, min(prompt_len + completion_len, max_length) - prompt_len)


def rows_without_loss_tokens(kind: str, columns: dict[str, list[int]], max_length: int | None, truncation_mode: str) -> list[int]:
    """Indices of the rows whose loss would be computed over zero tokens.

    Args:
        kind (`str`): `"reward"`, `"dpo"` or `"kto"`.
        columns (`dict[str, list[int]]`): token counts per row for each tokenized column (`prompt_ids`, ...).
        max_length (`int | None`): the trainer's `max_length`.
        truncation_mode (`str`): DPO's `truncation_mode` (KTO always keeps the start).
    """
    if kind == "reward":
        return [i for i, (c, r) in enumerate(zip(columns["chosen_ids"], columns["rejected_ids"])) if c == 0 or r == 0]
    prompts = columns["prompt_ids"]
    sides = ["chosen_ids", "rejected_ids"] if kind == "dpo" else ["completion_ids"]
    return [
        i
        for i, p in enumerate(prompts)
        if any(kept_completion_tokens(p, columns[side][i], max_length, truncation_mode) == 0 for side in sides)
    ]


TOKENIZED_COLUMNS = {
    "reward": ("chosen_ids", "rejected_ids"),
    "dpo": ("prompt_ids", "chosen_ids", "rejected_ids"),
    "kto": ("prompt_ids", "completion_ids"),
}


def token_counts(dataset, names: tuple[str, ...]) -> dict[str, list[int]] | None:
    """Per-row lengths of the list columns `names`, computed in Arrow without decoding rows; `None` if unavailable."""
    import pyarrow.compute as pc

    if not hasattr(dataset, "with_format") or not all(n in (dataset.column_names or []) for n in names):
        return None
    table = dataset.with_format("arrow")[:]
    return {n: pc.fill_null(pc.list_value_length(table.column(n)), 0).to_pylist() for n in names}


class NoLossTokens(Rule):
    """Examples with zero loss tokens after tokenization/truncation are dropped (counted); none left is an error.

    What it changes:
        *(built)* after tokenization, examples left with zero loss tokens once the collator truncates to `max_length`
        (the prompt fills the sequence, or the completion is empty) are dropped, with the count in the report; SFT:
        rows whose labels leave the causal loss nothing to score after `completion_only_loss` / `assistant_only_loss`
        masking and `max_length` truncation are dropped, and the rows TRL's preparation dropped itself are counted;
        none left is blocked.

    Why:
        a mean over zero tokens is NaN; SFT clamps the count and logs loss 0.0 for a batch of them
        ([trl#6668](https://github.com/huggingface/trl/issues/6668))

    Opt out:
        `safety_disable_rules=["data.no_loss_tokens"]`.
    """

    id = "data.no_loss_tokens"
    summary = "Examples with zero loss tokens after tokenization/truncation are dropped (counted); none left is an error."
    trainers = frozenset({"sft", "reward", "dpo", "kto"})
    rationale = "https://github.com/OpenRLHF/OpenRLHF/commit/0fdee11b"

    def check_built(self, built: BuiltTrainer) -> Finding | None:
        dataset = built.train_dataset
        if dataset is None or not hasattr(dataset, "__len__"):
            return None
        max_length = getattr(built.args, "max_length", None)
        if built.kind == "sft":
            cause, effect, missing = data_sft.cause(built.args), data_sft.EFFECT, "token to train on"
        else:
            cause = f"the prompt fills `max_length={max_length}`, or the completion is empty" if max_length else (
                "the completion is empty"
            )
            effect, missing = "their loss would be NaN (a mean over zero tokens)", "completion token"
        source = built.source_rows
        if len(dataset) == 0:
            if source:
                return self.blocked(
                    f"all {source} training examples were dropped during tokenization ({cause}), so there is "
                    "nothing to train on. Raise `max_length`, shorten the prompts, or check the completion column."
                )
            return None
        if built.kind == "sft":
            bad = data_sft.rows_without_loss_tokens(dataset)
        else:
            counts = token_counts(dataset, TOKENIZED_COLUMNS[built.kind])
            truncation_mode = getattr(built.args, "truncation_mode", "keep_start")
            bad = rows_without_loss_tokens(built.kind, counts, max_length, truncation_mode) if counts else []
        total = len(dataset)
        # Packing merges examples into rows, so the row count says nothing about dropped examples.
        packed = getattr(built.args, "packing", False)
        dropped_upstream = (source - total) if source is not None and source > total and not packed else 0
        if bad and len(bad) == total:
            return self.blocked(
                f"all {total} training examples have no {missing} left after tokenization ({cause}), so every "
                "loss is a mean over nothing. Raise `max_length`, shorten the prompts, or check the completion "
                "column."
            )
        if bad:
            note = f" TRL's preprocessing had already dropped {dropped_upstream}." if dropped_upstream else ""
            return self.fixed(
                f"{len(bad)} of {total} training examples have no {missing} left after tokenization ({cause}); "
                f"{effect}. Dropped them (first: row {bad[0]}).{note}",
                Change("train_dataset.num_rows", total, total - len(bad)),
                drop_rows=bad,
            )
        if dropped_upstream:
            return self.warned(
                f"{dropped_upstream} of {source} training examples were dropped by TRL's preprocessing (for example "
                f"{cause}); {total} remain."
            )
        return None

    def apply_built(self, trainer, finding: Finding) -> None:
        drop = set(finding.data["drop_rows"])
        dataset = trainer.train_dataset
        trainer.train_dataset = dataset.select([i for i in range(len(dataset)) if i not in drop])
