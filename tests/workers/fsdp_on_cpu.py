"""Test-only harness: let accelerate take its FSDP branch on CPU ranks (gloo), as it does on a GPU machine.

accelerate 1.15 switches to `DistributedType.FSDP` only for accelerator device types, so on a multi-CPU run the
Trainer's FSDP plugin is silently dropped and the model trains under plain DDP. Right after `AcceleratorState`
initialises, this harness does what accelerate does on a GPU machine: sets the distributed type to FSDP and keeps the
plugin. The Trainer then shards the model with torch's `fully_shard` (FSDP2, DTensor parameters) on the CPU ranks.

Never imported by the package; the workers call [`enable`] before they build a trainer.
"""

from __future__ import annotations

import functools

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

_ORIGINAL_INIT = AcceleratorState.__init__


def enable() -> None:
    """Install the harness (idempotent)."""
    if getattr(AcceleratorState.__init__, "_fsdp_on_cpu", False):
        return

    @functools.wraps(_ORIGINAL_INIT)
    def init(self, *args, fsdp_plugin=None, **kwargs):
        _ORIGINAL_INIT(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if self.distributed_type != DistributedType.MULTI_CPU:
            return
        if fsdp_plugin is not None:
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
        # Also on later `AcceleratorState()` calls (TRL's GRPO seeds per device through one), which re-derive the
        # distributed type from the shared state.
        if getattr(self, "fsdp_plugin", None) is not None:
            self.distributed_type = DistributedType.FSDP

    init._fsdp_on_cpu = True
    AcceleratorState.__init__ = init
