"""Values the ranks agreed on the device at a step's end (riding on the guard's all-reduce, `runtime/ports.py`
`FlagRider`), read on the host a step or more later, so that reading them never waits for the step just queued: on
CUDA each is copied to pinned host memory behind an event, elsewhere kept as is. The preemption bits
(`restarts/preemption.py` `AgreedBits`), the writers' bit (`restarts/writers_done.py`) and the hang relay's vectors
(`restarts/hang_relay.py`) are kept here."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from .host_buffers import queue_host_copy


class AgreedValues:
    """The agreed values of the steps not read yet, in step order (`pending`: `(step, value, event or None)`)."""

    def __init__(self):
        self.pending: deque[tuple[int, torch.Tensor, Any]] = deque()

    def keep(self, step: int, value: torch.Tensor) -> None:
        """Keep step `step`'s agreed `value` (a device tensor: not read now)."""
        if value.is_cuda:
            host = queue_host_copy(torch.empty(value.shape, dtype=value.dtype, pin_memory=True), value)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((step, host, event))
        else:
            self.pending.append((step, value, None))

    def read_through(self, step: int | None, wait: bool = True) -> list[tuple[int, torch.Tensor]]:
        """The values of the steps up to `step` (`None`: all), each once, as host tensors. The wait is on work queued a
        step ago or more, long complete; `wait=False` waits for nothing and drops a copy the device has not completed
        (it may be failing)."""
        out = []
        while self.pending and (step is None or self.pending[0][0] <= step):
            at, value, event = self.pending.popleft()
            if event is not None:
                if not wait and not event.query():
                    continue
                event.synchronize()
            out.append((at, value))
        return out

    def clear(self) -> None:
        self.pending.clear()


__all__ = ["AgreedValues"]
