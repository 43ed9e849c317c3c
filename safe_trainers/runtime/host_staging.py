"""A checkpoint's state staged in host memory, for a background thread to write while training goes on.

A background save (`restarts/background_save.py`) copies what a synchronous save would write (the model's state dict,
the optimizer's) into reused host buffers ([`HostBuffers`]: allocated and touched once, so a later save is a plain
copy), and hands the copies to a writer thread. Tensors that share memory on the device (tied embeddings) share one
host copy, so `save_pretrained` sees them tied, as it would the device tensors. From a CUDA device the copies are
queued without blocking; the writer waits on [`StagedState.ready`] before it reads them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .host_buffers import HostBuffers, queue_host_copy
from .nested import map_tensors, tensors
from .sharding import local


@dataclass
class StagedState:
    """A nested structure of tensors copied to host memory.

    Args:
        value (`Any`): the structure, every tensor replaced by its host copy (other leaves deep-copied).
        ready (`Callable[[], None]`): returns once every copy has landed (from a CUDA device: an event's wait).
    """

    value: Any
    ready: Callable[[], None]


def _memory_key(tensor: torch.Tensor) -> tuple:
    """What makes two tensors the same memory: the same storage, offset, shape, strides and dtype."""
    storage = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
    return (storage, tensor.device, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _distinct(value: Any) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct tensors of `value` (shared memory once) and, for each of its tensors, the index of its own."""
    index: dict[tuple, int] = {}
    distinct: list[torch.Tensor] = []
    slots = []
    for tensor in (local(t).detach() for t in tensors(value)):
        key = _memory_key(tensor)
        if key not in index:
            index[key] = len(distinct)
            distinct.append(tensor)
        slots.append(index[key])
    return distinct, slots


def _layout(distinct: list[torch.Tensor]) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], bool]:
    return [(tuple(t.shape), t.dtype) for t in distinct], any(t.is_cuda for t in distinct)


def prepare_staging(value: Any, buffers: HostBuffers) -> None:
    """Allocate `buffers` for `value`'s layout on a background thread ([`HostBuffers.prepare`]), so that the first
    [`stage_to_host`] of a state with that layout is a plain copy."""
    specs, on_cuda = _layout(_distinct(value)[0])
    buffers.prepare(specs, pin=on_cuda)


def stage_to_host(value: Any, buffers: HostBuffers) -> StagedState:
    """Copy every tensor of `value` into `buffers` (one view per distinct tensor; shared memory stays shared).

    Args:
        value (`Any`): dicts, lists and tuples of tensors (a state dict, an optimizer's state dict).
        buffers ([`HostBuffers`]): reused from one save to the next while the layout holds; the previous copies must
            no longer be read (the previous save was written).
    """
    distinct, slots = _distinct(value)
    specs, on_cuda = _layout(distinct)
    views = buffers.views(specs, pin=on_cuda)
    copies = [queue_host_copy(view, tensor) for view, tensor in zip(views, distinct)]
    order = iter(slots)
    staged = map_tensors(value, lambda _: copies[next(order)], copy.deepcopy)
    if not on_cuda:
        return StagedState(staged, lambda: None)
    event = torch.cuda.Event()
    event.record()
    return StagedState(staged, event.synchronize)


__all__ = ["StagedState", "prepare_staging", "stage_to_host"]
