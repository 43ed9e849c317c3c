"""Walking nested structures of tensors: dicts (and other mappings, such as `BatchEncoding`), lists and tuples.

The one walker of the package: micro-batch inputs (`diagnosis.py`), the optimizer state copied to host memory
(`host_buffers.py`) and the state dicts of checkpoint files (`restarts/checkpoint_choice.py`) are all read in the same
order, the order in which [`map_tensors`] rebuilds them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def named_tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `value`, depth first, with a dotted name of the keys and indices that lead to it.

    Example:
        ```python
        >>> [name for name, _ in named_tensors({"state": {0: {"exp_avg": torch.zeros(2)}}, "lr": [torch.ones(1)]})]
        ['state.0.exp_avg', 'lr.0']
        ```
    """
    if torch.is_tensor(value):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from named_tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from named_tensors(item, f"{prefix}.{i}" if prefix else str(i))


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor of `value`, in the order of [`named_tensors`]."""
    return (tensor for _, tensor in named_tensors(value))


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] = lambda leaf: leaf) -> Any:
    """`value` rebuilt with `fn` applied to every tensor (in the order of [`named_tensors`]) and `other` to every
    other leaf; mappings come back as plain dicts, lists and tuples as their own type."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, Mapping):
        return {key: map_tensors(item, fn, other) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(item, fn, other) for item in value)
    return other(value)


__all__ = ["map_tensors", "named_tensors", "tensors"]
