"""The CPU sync lint: [`HostReads`] records the calls that bring a tensor's value to the host, made inside it.

On a CPU there is no device to wait for, so a host-device synchronisation shows only as the call that would cause one
on a GPU: `.item()`, `bool(t)`, `.tolist()`, `.cpu()`, `torch.equal`... (`tests/gpu/sync_watch.py` watches CUDA's own
synchronisations on a GPU). A move onto the host, `.to("cpu")`, cannot be told from a move onto the training device
here, so it is not counted.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


HOST_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.__format__, torch.Tensor.numpy, torch.Tensor.cpu, torch.equal,
    torch.Tensor.equal,
})  # fmt: skip


class HostReads(TorchFunctionMode):
    """Records in `reads` the name of each call of [`HOST_READS`] made inside it, on any tensor.

    Args:
        reads (`list[str]`, *optional*): where to record them (a new list by default).
    """

    def __init__(self, reads: list[str] | None = None):
        super().__init__()
        self.reads = [] if reads is None else reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))
