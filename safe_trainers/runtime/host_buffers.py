"""Host memory for the guard's copies of device tensors: one buffer per dtype, sized exactly, a view for each tensor.

The snapshot (`rollback/memory.py`) and the diagnosis's micro-batch copies (`diagnosis.py`) keep device tensors in host
memory. Pinning one host tensor per tensor goes through CUDA's caching host allocator, which rounds every block up to
a power of two and keeps it (a 37.7 MB tensor takes a 64 MB block): the memory held was up to twice the bytes
copied. Here each dtype gets one plain host buffer of exactly the bytes its tensors need, allocated once for a layout
and reused while the layout holds, and page-locked in place (`cudaHostRegister`) when the tensors come from a CUDA
device, so that non-blocking device-to-host copies can land in it. Each tensor is a view of its dtype's buffer, so
every view is aligned for its dtype. On a CPU-only run nothing is pinned; the layout is the same. The snapshot's copies
run on a side stream (`copy_stream.py`, through `copy_to_host`'s `stream`); buffers are reused only by copies queued
behind the previous ones on the same stream, and unpinned only after a device synchronisation (`release`).

Two ways to get a destination, one way to copy into it: [`HostBuffers`] for a fixed list of shapes (the snapshot,
through [`copy_to_host`]; a background save's staging, `host_staging.py`), `HostArena` for shapes that change from one
use to the next (micro-batches, `host_arena.py`); both copy through [`queue_host_copy`].
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .nested import map_tensors, tensors
from .sharding import local

logger = logging.getLogger("safe_trainers")


def queue_host_copy(destination: torch.Tensor, source: torch.Tensor, stream: Any = None) -> torch.Tensor:
    """Copy `source` into the host tensor `destination` and return `destination`. From a CUDA device the copy is
    queued on the current stream without blocking the host: `destination` must be pinned, and is read only after an
    event recorded behind the copy (or a host synchronisation). `stream`: the side stream the caller made current
    for the copy (`copy_stream.py`), whose use of `source` the caching allocator must know of (`record_stream`)."""
    if stream is not None and source.is_cuda:
        source.record_stream(stream)
    return destination.copy_(source, non_blocking=source.is_cuda)


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives: `numel` elements of its dtype's buffer from element `offset`, viewed as `shape`."""

    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def plan(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[dict[torch.dtype, int], list[Slot]]:
    """Lay out tensors of the given `(shape, dtype)`s back to back, one buffer per dtype.

    Returns:
        The number of elements of each dtype's buffer (dtypes in order of first appearance) and each tensor's
        [`Slot`], in the order of `specs`.
    """
    sizes: dict[torch.dtype, int] = {}
    slots = []
    for shape, dtype in specs:
        slot = Slot(dtype, sizes.get(dtype, 0), tuple(shape))
        sizes[dtype] = slot.offset + slot.numel
        slots.append(slot)
    return sizes, slots


class HostBuffers:
    """One exactly sized host buffer per dtype for a fixed list of tensor shapes, and a view of it for each tensor.

    [`views`] allocates the buffers the first time and whenever the shapes change (a snapshot before the optimizer's
    first step has no moments yet), and returns the same views otherwise.

    With `pin=True` (tensors copied from a CUDA device) the buffers are page-locked, for non-blocking copies; when
    the CUDA runtime refuses (a locked-memory limit) they stay pageable, with a warning, and copies wait for the
    device.

    Args:
        separate (`bool`, *optional*, defaults to `False`): one exactly sized buffer per tensor instead of per dtype,
            for copies that are written to files as they are (a background save): `save_pretrained` takes tensors
            that share a storage for tied weights, and `torch.save` writes the storages, so the files match a
            synchronous save's.
    """

    def __init__(self, separate: bool = False):
        self.separate = separate  # each tensor in a storage of its own (see the class docstring)
        self.buffers: dict[Any, torch.Tensor] = {}
        self.pinned = False
        self.allocations = 0  # how many times [`views`] allocated (a new layout): a one-time cost, not a copy's
        self.allocation_seconds = 0.0  # the host time the last allocation took (its pages touched or page-locked)
        self._signature: tuple | None = None
        self._views: list[torch.Tensor] = []
        self._unpin = None
        self._preparing: tuple[threading.Thread, list] | None = None  # [`prepare`]'s thread and what it allocated

    def views(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], pin: bool = False) -> list[torch.Tensor]:
        """A view per `(shape, dtype)` of `specs`, each in its dtype's buffer (reused when `specs` and `pin` are
        unchanged; taken from [`prepare`] when it allocated them for this layout)."""
        signature = (pin, *((tuple(shape), dtype) for shape, dtype in specs))
        prepared = self._join_preparing()
        if prepared and prepared[0] == signature and signature != self._signature:
            self._adopt(prepared)
            self.allocation_seconds = 0.0  # allocated off the caller's path
        elif prepared:
            _drop(prepared)  # a layout that changed since
        if signature != self._signature:
            self.release()  # the old layout's buffers go before the new ones come: never both held
            began = time.perf_counter()
            self._adopt(_allocate(signature, self.separate))
            self.allocation_seconds = time.perf_counter() - began
        return self._views

    def _join_preparing(self) -> list:
        """What [`prepare`]'s thread allocated (once it is done), taken from it; empty when nothing was prepared."""
        if self._preparing is None:
            return []
        thread, prepared = self._preparing
        thread.join()
        self._preparing = None
        return prepared

    def _adopt(self, allocation: tuple) -> None:
        self.release()
        self.allocations += 1
        self._signature, self.buffers, self._views, registered = allocation
        self.pinned = bool(registered)
        if registered:
            # Unpinned when released or garbage-collected; the finalizer holds the buffers until then, so their
            # memory is never freed while registered. Not at exit: the process's memory goes with it.
            self._unpin = weakref.finalize(self, _unregister, registered)
            self._unpin.atexit = False

    def prepare(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], pin: bool = False) -> None:
        """Allocate (and touch, or page-lock) the buffers of a layout on a background thread, so that the first
        [`views`] for it does not pay for it (a background save's first copy). Does nothing for the layout held."""
        signature = (pin, *((tuple(shape), dtype) for shape, dtype in specs))
        if signature == self._signature or self._preparing is not None:
            return
        prepared: list = []
        allocate = lambda: prepared.extend(_allocate(signature, self.separate))  # noqa: E731
        thread = threading.Thread(target=allocate, name="safe_trainers-host-buffers", daemon=True)
        self._preparing = (thread, prepared)
        thread.start()

    def nbytes(self) -> int:
        """The bytes the buffers hold (exactly the bytes of the tensors laid out in them)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def release(self) -> None:
        """Drop the buffers (unpinning them first, once every queued copy has finished), and any being prepared."""
        _drop(self._join_preparing())
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.buffers, self._views, self._signature, self.pinned = {}, [], None, False


def _allocate(signature: tuple, separate: bool = False) -> tuple:
    """The buffers of a layout (`(pin, *(shape, dtype))`), every page mapped now, not in the first copy (whose time is
    a copy's): `(signature, buffers, views, registered)`, `registered` the buffers page-locked. `separate`: a buffer
    per tensor, else per dtype."""
    pin, specs = signature[0], signature[1:]
    if separate:
        buffers = {i: torch.empty(shape, dtype=dtype) for i, (shape, dtype) in enumerate(specs)}
    else:
        sizes, slots = plan(specs)
        buffers = {dtype: torch.empty(n, dtype=dtype) for dtype, n in sizes.items()}
    registered = _pin(buffers) if pin else []
    if not registered:
        for buffer in buffers.values():
            buffer.zero_()
    if separate:
        return signature, buffers, list(buffers.values()), registered
    views = [buffers[s.dtype][s.offset : s.offset + s.numel].view(s.shape) for s in slots]
    return signature, buffers, views, registered


def _drop(prepared: list) -> None:
    """Let go of buffers [`HostBuffers.prepare`] allocated and nobody adopted (unpinned first)."""
    if prepared:
        _unregister(prepared[3])
        prepared.clear()


def _pin(buffers: dict[Any, torch.Tensor]) -> list[torch.Tensor]:
    """Page-lock `buffers` in place (which maps every page); the buffers locked (none when the runtime refused)."""
    registered = []
    for buffer in buffers.values():
        if buffer.numel() and not _register(buffer):
            _unregister(registered)
            logger.warning(
                "NaN guard: could not page-lock a host buffer of the snapshot (the locked-memory limit, `ulimit "
                "-l`?); it stays in pageable memory, so copies to it wait for the device."
            )
            return []
        if buffer.numel():
            registered.append(buffer)
    return registered


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer`'s memory in place for the CUDA runtime; whether it worked."""
    try:
        cudart = torch.cuda.cudart()
        result = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    except (RuntimeError, AttributeError, AssertionError):
        return False
    if result != cudart.cudaError.success:
        _consume_cuda_error()
        return False
    return True


def _consume_cuda_error() -> None:
    """Clear the error a refused `cudaHostRegister` leaves in the CUDA runtime's last-error slot.

    torch checks that slot after its next kernel launch and raises what it finds there, so the refusal would surface
    as a "CUDA error" in an unrelated operation of the training step, not as the pageable fallback intended. torch
    exposes no `cudaGetLastError`: one tiny kernel launch reads the slot, which resets it, and what it raises is the
    refusal already reported.
    """
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


def _unregister(buffers: list[torch.Tensor]) -> None:
    if not buffers:
        return
    torch.cuda.synchronize()  # no copy to or from the buffers may still be queued
    cudart = torch.cuda.cudart()
    for buffer in buffers:
        cudart.cudaHostUnregister(buffer.data_ptr())
    buffers.clear()


def copy_to_host(value: Any, buffers: HostBuffers, stream: Any = None) -> Any:
    """A host copy of a nested structure (dicts, lists, tuples) of tensors: every tensor copied into a view of
    `buffers` (non-blocking from a CUDA device: wait on an event recorded after it before reading), every other leaf
    deep-copied. A `DTensor` is copied as this rank's shard. `stream`: a CUDA stream to queue the copies on instead
    of the current one (`copy_stream.py`)."""
    leaves = [local(t).detach() for t in tensors(value)]
    views = buffers.views([(tuple(t.shape), t.dtype) for t in leaves], pin=any(t.is_cuda for t in leaves))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        held = iter([queue_host_copy(view, tensor, stream) for view, tensor in zip(views, leaves)])
    return map_tensors(value, lambda _: next(held), copy.deepcopy)


__all__ = ["HostBuffers", "Slot", "copy_to_host", "plan", "queue_host_copy"]
