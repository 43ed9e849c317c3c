"""Host copies of tensors whose shapes change from one use to the next: the diagnosis's micro-batch copies
(`guard/diagnosis.py`), in buffers reused as [`HostBuffers`] are (`host_buffers.py`)."""

from __future__ import annotations

import torch

from .host_buffers import HostBuffers, queue_host_copy


class HostArena:
    """Host copies of tensors whose shapes change from one use to the next (micro-batches), all dropped together by
    [`reset`]: one buffer per dtype (pinned for copies from a CUDA device), carved in order.

    A copy that does not fit gets a buffer of its own, exactly sized; at the next reset the dtype's buffer is
    reallocated to exactly the largest total seen between two resets, so after the first windows the arena holds
    one buffer per dtype, allocated once and reused.
    """

    def __init__(self):
        self.main = HostBuffers()
        self.capacity: dict[torch.dtype, int] = {}
        self.used: dict[torch.dtype, int] = {}
        self.demand: dict[torch.dtype, int] = {}
        self.overflow: list[HostBuffers] = []
        self.pin = False

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor`; from a CUDA device it is queued without blocking (read it after a host sync)."""
        dtype, n = tensor.dtype, tensor.numel()
        self.pin = tensor.is_cuda
        start = self.used.get(dtype, 0)
        self.demand[dtype] = self.demand.get(dtype, 0) + n
        if dtype in self.capacity and start + n <= self.capacity[dtype]:  # an empty tensor of a new dtype: no buffer
            self.used[dtype] = start + n
            view = self.main.buffers[dtype][start : start + n].view(tensor.shape)
        else:
            extra = HostBuffers()
            self.overflow.append(extra)
            view = extra.views([(tuple(tensor.shape), dtype)], pin=self.pin)[0]
        return queue_host_copy(view, tensor)

    def reset(self) -> None:
        """Drop every copy (their views must no longer be read); grow the buffers if some copy did not fit."""
        if self.overflow:
            for extra in self.overflow:
                extra.release()
            self.overflow = []
            dtypes = {*self.capacity, *self.demand}
            self.capacity = {d: max(self.capacity.get(d, 0), self.demand.get(d, 0)) for d in dtypes}
            self.main.views([((n,), d) for d, n in self.capacity.items()], pin=self.pin)
        self.used, self.demand = {}, {}

    def nbytes(self) -> int:
        """The bytes held: the buffers and the copies that did not fit."""
        return self.main.nbytes() + sum(extra.nbytes() for extra in self.overflow)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view of one of the arena's buffers."""
        storage = tensor.untyped_storage().data_ptr()
        buffers = [*self.main.buffers.values(), *(b for extra in self.overflow for b in extra.buffers.values())]
        return any(b.untyped_storage().data_ptr() == storage for b in buffers)


__all__ = ["HostArena"]
