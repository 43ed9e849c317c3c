"""SFT part of the `data.no_loss_tokens` rule: which tokenized SFT examples leave the loss nothing to train on.

TRL's SFT preparation builds a `labels` column (`-100` where `completion_only_loss` or `assistant_only_loss` masks a
token), truncates to `max_length` and drops the examples left with no label. It keeps an example whose only label is
its first token, which the causal loss never scores (token `i` is predicted from the tokens before it), and drops
nothing when `max_length=None` or with `packing`. Such examples reach the loss with zero tokens, and TRL clamps the
count to 1: a batch of them trains on nothing and logs a loss of 0.0
([trl#6668](https://github.com/huggingface/trl/issues/6668)).
"""

from __future__ import annotations

from typing import Any



def loss_token_counts(dataset: Any) -> list[int] | None:
    """Per row of a tokenized SFT dataset, the number of tokens the loss is computed over.

    That is the labels other than `-100` after the first position, or, without a `labels` column (the collator then
    uses `input_ids`), every token after the first. Computed in Arrow without decoding rows; `None` when the dataset
    has neither column or is not an Arrow-backed `Dataset`.
    """
    import pyarrow.compute as pc

    names = getattr(dataset, "column_names", None) or []
    column = "labels" if "labels" in names else "input_ids" if "input_ids" in names else None
    if column is None or not hasattr(dataset, "with_format"):
        return None
    values = dataset.with_format("arrow")[:].column(column).combine_chunks()
    scored = pc.list_slice(values, 1)  # the first label is never predicted
    if column == "input_ids":
        return pc.fill_null(pc.list_value_length(scored), 0).to_pylist()
    parents = pc.list_parent_indices(scored).to_numpy(zero_copy_only=False)
    kept = pc.not_equal(pc.list_flatten(scored), -100).to_numpy(zero_copy_only=False)
    import numpy as np

    return np.bincount(parents[kept], minlength=len(values)).tolist()


def rows_without_loss_tokens(dataset: Any) -> list[int]:
    """Indices of the rows of a tokenized SFT dataset whose loss would be computed over zero tokens."""
    counts = loss_token_counts(dataset)
    return [i for i, n in enumerate(counts or []) if n == 0]


def cause(args: Any) -> str:
    """Why an SFT example can be left with no token to train on, for the settings in `args`."""
    masks = []
    if getattr(args, "completion_only_loss", None) is not False:
        masks.append("`completion_only_loss`")
    if getattr(args, "assistant_only_loss", False):
        masks.append("`assistant_only_loss`")
    how = [f"masked by {' or '.join(masks)}"] if masks else []
    max_length = getattr(args, "max_length", None)
    if max_length is not None and not getattr(args, "packing", False):
        how.append(f"cut by `max_length={max_length}`")
    labels = f"every label is {' or '.join(how)}" if how else "every label is `-100`"
    return f"{labels}, or the sequence is a single token, e.g. an empty text plus EOS"


EFFECT = "TRL clamps the token count to 1, so a batch of them trains on nothing and logs a loss of 0.0 (trl#6668)"
