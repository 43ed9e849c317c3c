"""A watch on the host-device synchronisations of chosen calls, for the GPU tests.

Two parts, active only inside a watched call:

- CUDA's sync debug mode (`torch.cuda.set_sync_debug_mode("error")`): raises on the implicit synchronisations of
  tensor operations (`.item()`, `bool()`, `.cpu()`, `nonzero`, a blocking copy...).
- the explicit waits, listed in call order: `torch.cuda.synchronize()` (which that mode does not see),
  `torch.cuda.Event.synchronize()`, `torch.cuda.Stream.synchronize()`, and the host waits of `torch.distributed`
  (`barrier`, `monitored_barrier`, and `Work.wait()` on a collective's handle). They are wrapped for the test only,
  through pytest's `monkeypatch` (undone when the test ends); the wrappers call the originals.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


EXPLICIT_WAITS: dict[str, tuple[Any, str]] = {
    "torch.cuda.synchronize": (torch.cuda, "synchronize"),
    "torch.cuda.Event.synchronize": (torch.cuda.Event, "synchronize"),
    "torch.cuda.Stream.synchronize": (torch.cuda.Stream, "synchronize"),
    "torch.distributed.barrier": (dist, "barrier"),
    "torch.distributed.monitored_barrier": (dist, "monitored_barrier"),
    "torch.distributed.Work.wait": (dist.Work, "wait"),
}


class SyncWatch:
    """Watches the calls made inside [`watching`] (or the methods given to [`watch_methods`]): implicit
    synchronisations raise, explicit waits are listed in `explicit` (in call order).

    Args:
        monkeypatch (`pytest.MonkeyPatch`): the test's fixture; it undoes the wrappers of the explicit waits.
    """

    def __init__(self, monkeypatch):
        self.active = False
        self._depth = 0
        self.explicit: list[str] = []
        self.calls: dict[str, int] = {}
        for label, (owner, name) in EXPLICIT_WAITS.items():
            monkeypatch.setattr(owner, name, self._counted(label, getattr(owner, name)))

    def _counted(self, label: str, original):
        def wait(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            self.explicit.append(label)
            self._depth += 1
            torch.cuda.set_sync_debug_mode("default")  # listed, not raised (the debug mode catches some of them)
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:  # `barrier` waits on its own handle: back to raising after the outer wait
                    torch.cuda.set_sync_debug_mode("error")

        return wait

    @contextmanager
    def watching(self):
        """Synchronisations raise and explicit waits are counted inside this block."""
        torch.cuda.set_sync_debug_mode("error")
        self.active = True
        try:
            yield self
        finally:
            self.active = False
            torch.cuda.set_sync_debug_mode("default")

    def watch_methods(self, owner: Any, names: tuple[str, ...], unless=lambda: False) -> None:
        """Run each method `names` of `owner` inside [`watching`], counting the calls in `calls`; a call made while
        `unless()` is true runs unwatched and uncounted."""
        for name in names:
            self.calls[name] = 0
            setattr(owner, name, self._watched(name, getattr(owner, name), unless))

    def _watched(self, name: str, method, unless):
        def run(*args, **kwargs):
            if unless():
                return method(*args, **kwargs)
            with self.watching():
                result = method(*args, **kwargs)
            self.calls[name] += 1
            return result

        return run
