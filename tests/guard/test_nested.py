"""`runtime/nested.py`: the one walker of nested tensors; a rebuild visits the tensors in the walker's order."""

from __future__ import annotations

import torch
from transformers import BatchEncoding

from safe_trainers.runtime.nested import map_tensors, named_tensors, tensors


def test_names_follow_the_keys_and_indices_depth_first():
    value = {"state": {0: {"exp_avg": torch.zeros(2), "step": 3}}, "groups": [{"lr": 0.1}], "x": (torch.ones(1),)}
    assert [name for name, _ in named_tensors(value)] == ["state.0.exp_avg", "x.0"]
    assert [name for name, _ in named_tensors(torch.ones(1), "w")] == ["w"]


def test_a_rebuild_takes_the_walkers_order_and_keeps_every_other_leaf():
    inputs = BatchEncoding({"input_ids": torch.tensor([[1, 2]]), "labels": [torch.tensor([3]), "text", None]})
    flat = list(tensors(inputs))
    assert [t.tolist() for t in flat] == [[[1, 2]], [3]]
    replaced = iter([torch.zeros(1, 2), torch.zeros(1)])
    rebuilt = map_tensors(inputs, lambda _: next(replaced))
    assert type(rebuilt) is dict and rebuilt["labels"][1:] == ["text", None]
    assert [t.tolist() for t in tensors(rebuilt)] == [[[0.0, 0.0]], [0.0]]
    marked = map_tensors({"a": [1, torch.ones(1)]}, lambda t: t, other=lambda leaf: ("kept", leaf))
    assert marked["a"][0] == ("kept", 1)
