"""Compilation is progress, not a hang: torch's compile hooks tell the hang watchdog and the step record.

`torch.compile` (the Trainer's `torch_compile=True`, or a model the user compiled) compiles on the first call, and
again on a new input shape, after an evaluation (another mode), after a rollback; inductor's C++/Triton build and
autotuning can take minutes on a real model, inside a step. TorchDynamo runs the callbacks registered with its
`callback_handler` when a compilation starts and when it ends (its forward, the lazily compiled backward and
cudagraph recording; nested compilations count once). [`CompileWatch`] registers one pair for the length of each
`train()` call and passes the news on to its listeners:

* the hang watchdog stops the step's clock while a compilation runs (see `watchdog.py`);
* the step record marks the step as compiling (phase `"compile"`), so a process that dies while compiling is not
  counted as killed by the step's batches (see `progress.py`): a step is never skipped because it compiled twice.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from torch._dynamo.callback import callback_handler


class CompileListener(Protocol):
    def compile_began(self) -> None: ...

    def compile_ended(self) -> None: ...


class CompileWatch:
    """Registers with TorchDynamo's compile callbacks while training runs, and tells its listeners.

    Args:
        listeners (`list`): objects with `compile_began()` and `compile_ended()` (called in the compiling thread).
    """

    def __init__(self, listeners: list[CompileListener]):
        self.listeners = listeners
        self.compiling = False  # a compilation began and has not ended (one at a time: torch counts the nesting)
        self._lock = threading.Lock()
        self._registered = False

    def register(self) -> None:
        """Register the callbacks, unless they are registered (`torch._dynamo.reset()` removes them)."""
        if self._began not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._began)
        if self._ended not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(self._ended)
        self._registered = True

    def unregister(self) -> None:
        """Remove the callbacks (`train()` is over, by a return or an exception); a compilation still marked as
        running is ended for the listeners."""
        if self._registered:
            for remove, callback in (
                (callback_handler.remove_start_callback, self._began),
                (callback_handler.remove_end_callback, self._ended),
            ):
                try:
                    remove(callback)
                except ValueError:  # `torch._dynamo.reset()` clears every callback
                    pass
            self._registered = False
        self._ended(None)

    def _began(self, _args: Any) -> None:
        with self._lock:
            if self.compiling:
                return
            self.compiling = True
        for listener in self.listeners:
            listener.compile_began()

    def _ended(self, _args: Any) -> None:
        with self._lock:
            if not self.compiling:  # registered while a compilation ran, or ended already
                return
            self.compiling = False
        for listener in self.listeners:
            listener.compile_ended()


__all__ = ["CompileListener", "CompileWatch"]
