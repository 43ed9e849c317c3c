"""A snapshot's device-to-host copies on a side CUDA stream, overlapped with the next steps' forward and backward.

Queued on the training stream, a snapshot's copies delay the next step by their whole duration (on one H100, a 0.57B
model's state took most of a step). [`CopyStream`] queues them on a side stream of the tensors' device instead:

1. the side stream waits for the training stream (`wait_stream`), so the copies read the state as of the snapshot;
2. the copies go, non-blocking, into page-locked host buffers (`host_buffers.py`), and every source tensor is marked
   as used by the side stream (`record_stream`): the caching allocator hands its memory to no other tensor before the
   copy has read it, even if the tensor is freed meanwhile (an optimizer state replaced by `load_state_dict`, a
   reallocated shard);
3. an event is recorded behind them: the snapshot's `ready`, and the copy [`CopyStream.pending`] a write must wait for.

The next forward and backward only read the weights and run alongside. The first later operation that writes the
copied state calls [`CopyStream.before_write`]: the training stream waits for the event on the device
(`wait_event`), never the host, and the event is dropped, so the steps after add no work. Its callers: the optimizer
step (`on_pre_optimizer_step`), the load of the best model at the end, and the end of `train()` (the caller's code
may write the weights next). A restore reads the host copy after waiting for the event on the host
(`Snapshot.wait`). Two snapshots in a row (a step's end, then its save) queue on the same side stream into the same
buffers, in order; buffers released for a new layout are unpinned only after the device is synchronised.

Where the copies cannot overlap they stay on the training stream, as before ([`copy_route`]).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .host_buffers import HostBuffers, copy_to_host
from .nested import tensors
from .sharding import local

HOST, TRAINING, SIDE = "host", "training", "side"
KEPT_TIMINGS = 8  # timed waits kept until read: enough for the snapshots between two reads
T = TypeVar("T")


def copy_route(devices: Iterable[torch.device], zero_stage: int | None = None) -> str:
    """Where a snapshot's copies run, for tensors on `devices`.

    Returns:
        `"host"`: no CUDA tensor, plain synchronous copies. `"training"`: queued on the training stream, as before,
        under DeepSpeed ZeRO (`zero_stage` set: its optimizer steps inside `backward`, where no hook runs before the
        update) and with tensors on more than one CUDA device. `"side"`: on a side stream of the one CUDA device.
    """
    cuda = {device for device in devices if device.type == "cuda"}
    if not cuda:
        return HOST
    return TRAINING if zero_stage is not None or len(cuda) > 1 else SIDE


def newest_done(items: Sequence[T], done: Callable[[T], bool]) -> int | None:
    """The index of the newest of `items` (oldest first) for which `done` holds, or `None`."""
    return next((i for i in range(len(items) - 1, -1, -1) if done(items[i])), None)


@dataclass(frozen=True)
class Pending:
    """Copies queued on a side stream that no write has waited for yet: `event` recorded behind them on `device`."""

    event: Any
    device: torch.device


class CopyStream:
    """Runs a snapshot's copies off the training stream and makes the first later write wait for them on the device.

    Attributes:
        route (`str | None`): the last snapshot's [`copy_route`] (`None` before the first).
        pending ([`Pending`] `| None`): the side-stream copies the next write waits for.
        timings (`deque`): pairs of timing events on the training stream around what it spent on the copies (the
            wait for side-stream copies, or the copies themselves on the training route), not yet read.
    """

    def __init__(self):
        self.route: str | None = None
        self.pending: Pending | None = None
        self.timings: deque[tuple[Any, Any]] = deque(maxlen=KEPT_TIMINGS)
        self._delay: float | None = None
        self._streams: dict[torch.device, Any] = {}

    def copy(self, value: Any, buffers: HostBuffers, zero_stage: int | None = None) -> tuple[Any, Any]:
        """Copy the tensors of `value` into `buffers` by their [`copy_route`] (`zero_stage`: DeepSpeed's, if any).

        Returns:
            The host copy ([`copy_to_host`]) and the CUDA event to wait for before reading it (`None`: read it now).
        """
        return self.run(value, lambda stream: copy_to_host(value, buffers, stream=stream), zero_stage)

    def run(self, value: Any, copies: Callable[[Any], T], zero_stage: int | None = None) -> tuple[T, Any]:
        """Run `copies(stream)`, which copies tensors of `value` to pinned host memory with [`queue_host_copy`] (a
        DDP rank's share of them, `replica_shards.py`), on the [`copy_route`] of `value`'s tensors: `stream` is the
        side stream to make current and pass on to [`queue_host_copy`], or `None` (the current stream).

        Returns:
            What `copies` returns and the CUDA event to wait for before reading the copies (`None`: read them now).
        """
        devices = {local(t).device for t in tensors(value)}
        route = copy_route(devices, zero_stage)
        self.route = route
        if route == HOST:
            return copies(None), None
        if route == TRAINING:
            self.before_write()  # a side-stream copy into the same buffers, if any, lands first
            start = _timing_event(torch.cuda.current_stream())
            held = copies(None)
            ready = _timing_event(torch.cuda.current_stream())
            self.timings.append((start, ready))
            return held, ready
        device = next(d for d in devices if d.type == "cuda")
        side = self._side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # the state as of now, not as the training goes on
        held = copies(side)
        ready = torch.cuda.Event()
        ready.record(side)
        self.pending = Pending(ready, device)
        return held, ready

    def before_write(self) -> None:
        """The copied state is about to be written: the training stream waits, on the device, for the copies still
        in flight (none after the first call: a no-op on the steps between snapshots)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        stream = torch.cuda.current_stream(pending.device)
        start = _timing_event(stream)
        stream.wait_event(pending.event)
        self.timings.append((start, _timing_event(stream)))

    def delay_seconds(self) -> float | None:
        """How long the training stream was held up by the copies of the last snapshot whose copies completed: on a
        side stream, the time it stood at the first write after the snapshot waiting for them (`0.0` when they were
        done by then; an upper bound when the host, not the device, paced the steps); on the training route, the
        copies' own time on it. Read with `Event.query()` and `elapsed_time`: never a host synchronisation.

        Returns:
            Seconds; `0.0` for host copies (synchronous: the caller times them on the host) and on a machine without
            CUDA; `None` before the first timed copy has completed on the device.
        """
        if self.route == HOST or (self.route is None and not torch.cuda.is_available()):
            return 0.0
        index = newest_done(self.timings, lambda pair: pair[1].query())
        if index is not None:
            start, end = self.timings[index]
            self._delay = start.elapsed_time(end) / 1000.0
            for _ in range(index + 1):
                self.timings.popleft()
        return self._delay

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


def _timing_event(stream: Any) -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


__all__ = ["HOST", "SIDE", "TRAINING", "CopyStream", "Pending", "copy_route", "newest_done"]
