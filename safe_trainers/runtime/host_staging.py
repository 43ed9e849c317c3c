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


def stage_to_host(value: Any, buffers: HostBuffers) -> StagedState:
    """Copy every tensor of `value` into `buffers` (one view per distinct tensor; shared memory stays shared).

    Args:
        value (`Any`): dicts, lists and tuples of tensors (a state dict, an optimizer's state dict).
        buffers ([`HostBuffers`]): reused from one save to the next while the layout holds; the previous copies must
            no longer be read (the previous save was written).
    """
    leaves = [local(t).detach() for t in tensors(value)]
    index: dict[tuple, int] = {}
    distinct: list[torch.Tensor] = []
    slots = []
    for tensor in leaves:
        key = _memory_key(tensor)
        if key not in index:
            index[key] = len(distinct)
            distinct.append(tensor)
        slots.append(index[key])
    on_cuda = any(t.is_cuda for t in distinct)
    views = buffers.views([(tuple(t.shape), t.dtype) for t in distinct], pin=on_cuda)
    copies = [queue_host_copy(view, tensor) for view, tensor in zip(views, distinct)]
    order = iter(slots)
    staged = map_tensors(value, lambda _: copies[next(order)], copy.deepcopy)
    if not on_cuda:
        return StagedState(staged, lambda: None)
    event = torch.cuda.Event()
    event.record()
    return StagedState(staged, event.synchronize)


__all__ = ["StagedState", "stage_to_host"]
