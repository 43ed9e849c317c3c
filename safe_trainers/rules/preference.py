"""Preference-loss rules: DPO/KTO need `beta` > 0; KTO needs batches of >= 2 and both kinds of label."""

from __future__ import annotations

import math

from ..report import Finding
from .base import Rule


class BetaPositive(Rule):
    id = "dpo.beta_positive"
    summary = "DPO and KTO need a finite `beta` > 0 (0 gives no gradient, and IPO-style losses divide by it)."
    trainers = frozenset({"dpo", "kto"})
    rationale = "https://github.com/huggingface/trl/blob/main/trl/trainer/dpo_trainer.py"

    def check(self, setup) -> Finding | None:
        beta = getattr(setup.args, "beta", None)
        if beta is None or (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
            return None
        return self.blocked(
            f"`beta={beta}`: the preference loss scales the log-ratio by `beta`, so `beta` <= 0 gives a constant loss "
            "with no gradient (or the wrong sign), and the IPO terms divide by it. Use a positive value, e.g. 0.1."
        )


def label_counts(dataset) -> tuple[int, int] | None:
    """`(desirable, undesirable)` counts of a KTO dataset's `label` column, or `None` if they can't be read cheaply."""
    if dataset is None or not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__"):
        return None
    if "label" not in (dataset.column_names or []):
        return None
    labels = dataset["label"]
    positives = sum(bool(v) for v in labels)
    return positives, len(labels) - positives


class KtoBatchAndLabels(Rule):
    id = "kto.batch_and_labels"
    summary = "KTO needs `per_device_train_batch_size` >= 2 and both desirable and undesirable examples."
    trainers = frozenset({"kto"})
    rationale = "https://github.com/OpenRLHF/OpenRLHF/issues/326"

    def check(self, setup) -> Finding | None:
        problems = []
        batch = setup.args.per_device_train_batch_size
        if batch < 2:
            problems.append(
                f"`per_device_train_batch_size={batch}`: KTO estimates its KL term from mismatched pairs inside a "
                "micro-batch, which needs at least 2 examples (a mean over an empty group is NaN). Use 2 or more."
            )
        counts = label_counts(setup.train_dataset)
        if counts is not None and (counts[0] == 0 or counts[1] == 0):
            missing = "desirable (`label=True`)" if counts[0] == 0 else "undesirable (`label=False`)"
            problems.append(
                f"the training dataset has {counts[0]} desirable and {counts[1]} undesirable examples: with no "
                f"{missing} example, that side of the KTO loss is a mean over nothing (NaN). Add examples of both kinds."
            )
        return self.blocked(" ".join(problems)) if problems else None
