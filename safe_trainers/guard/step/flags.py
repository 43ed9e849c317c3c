"""The guard's per-step hot path: device flags for each optimizer step, read back only at inspections.

Every micro-batch loss is folded into a device flag; after gradient clipping the flag is combined with the gradient
norm and agreed across ranks with one small all-reduce, which also carries the step's loss (the largest rank's), so
that the spike detector (`spikes.py`) judges the same values on every rank. A spike joins the step's skip flag, so it
is skipped where a non-finite step is. Nothing here reads a tensor on the host: the flags of the steps not yet
inspected wait on the device as [`PendingStep`] records, and [`StepFlags.read`] brings them back in one transfer when
the guard inspects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ...runtime.collectives import max_across_ranks, ranks_with_flag
from ...runtime.sharding import replicated
from ..policy import StepReading
from .skip import clear_found_inf, skip_if_faulted, unwrap_optimizer
from .spikes import SpikeWindow


class PendingStep(NamedTuple):
    """The device flags of one optimizer step, kept until the next inspection.

    Args:
        step (`int`): the optimizer step (1-based, as `global_step` after it).
        fault (`torch.Tensor`): any rank's loss non-finite, or (without a loss scaler) the gradient non-finite.
        local (`torch.Tensor`): this rank's loss non-finite.
        loss (`torch.Tensor`): the sum of this rank's micro-batch losses.
        grad_norm (`torch.Tensor`): the (world-reduced) gradient norm.
        overflow (`torch.Tensor`): the loss scaler's overflow (finite loss, non-finite gradients under fp16).
        spike (`torch.Tensor`): the spike detector found the step spiking (its update is skipped where the guard
            skips; under DeepSpeed, which steps inside `backward`, it was applied).
        judged_loss (`torch.Tensor`): the loss the spike detector judged, the largest rank's (the same on every rank).
    """

    step: int
    fault: torch.Tensor
    local: torch.Tensor
    loss: torch.Tensor
    grad_norm: torch.Tensor
    overflow: torch.Tensor
    spike: torch.Tensor
    judged_loss: torch.Tensor


class StepFlags:
    """Folds the losses and gradient norm of each step into device flags (see the module docstring).

    Args:
        loss_scaled (`bool`): an fp16 loss scaler is active: non-finite gradients with a finite loss are its
            overflows (it skips the step itself), not faults.
        spikes ([`SpikeWindow`], *optional*): the spike detector; `None` when spike detection is off.
    """

    def __init__(self, loss_scaled: bool = False, spikes: SpikeWindow | None = None):
        self.loss_scaled = loss_scaled
        self.spikes = spikes
        self.pending: list[PendingStep] = []
        self.fault_now: torch.Tensor | None = None
        self._loss_bad: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Fold one micro-batch loss (as `training_step` returns it) into the step's flag and sum."""
        value = loss.detach().float()
        bad = ~torch.isfinite(value).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        value = value.sum()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    def end_step(
        self,
        step: int,
        grad_norm: Any,
        device: Any,
        optimizer_skipped: bool = False,
        dropped: bool = False,
        riders: Sequence[Any] = (),
    ) -> torch.Tensor:
        """Close step `step`: combine the loss flag with the gradient norm, agree across ranks (one all-reduce), judge
        the spike detector, keep the record, and return the device skip flag (a fault or a spike).
        `optimizer_skipped`: DeepSpeed already skipped this step. `dropped`: every rank left this step's batches
        untrained (a poisoned step): a fault, whatever the scaler. `riders`: flags that ride on the same all-reduce
        (the preemption bit, `restarts/preemption.py`; the checkpoint writers' bit, `restarts/writers_done.py`; the
        hangs' values, `restarts/hang_relay.py`): each one's `local_bit(device)`, a bit or a vector, is reduced across
        ranks and handed back, on the device, to its `agreed(step, value)` ([`hand_back`])."""
        local = self._loss_bad if self._loss_bad is not None else torch.zeros((), dtype=torch.bool, device=device)
        norm = (
            grad_norm
            if torch.is_tensor(grad_norm)
            else torch.tensor(float("nan") if grad_norm is None else float(grad_norm), device=device)
        )
        norm = replicated(norm).detach().float().to(local.device)  # FSDP2 returns it as a `DTensor`
        norm_bad = ~torch.isfinite(norm)
        if optimizer_skipped:
            norm_bad = norm_bad | torch.tensor(True, device=local.device)
        loss = self._loss_sum if self._loss_sum is not None else torch.zeros((), device=local.device)
        judged_loss = torch.nan_to_num(loss.float(), nan=0.0, posinf=0.0, neginf=0.0)  # a non-finite loss is a fault
        riding = [(rider, bit) for rider in riders if (bit := rider.local_bit(local.device)) is not None]
        values = [local, norm_bad, judged_loss] + [bit for _, bit in riding]
        # [any rank's loss non-finite, gradient non-finite, the largest rank's loss, (the riders' flags and values)]
        agreed = max_across_ranks(torch.cat([v.float().reshape(-1) for v in values]))
        hand_back(step, riding, agreed, start=3)
        loss_bad_any, norm_bad_any = agreed[0] > 0, agreed[1] > 0
        if self.loss_scaled:
            fault, overflow = loss_bad_any, norm_bad_any & ~loss_bad_any
        else:
            fault = loss_bad_any | norm_bad_any
            overflow = torch.zeros_like(fault)
        if dropped:
            fault, overflow = torch.ones_like(fault), torch.zeros_like(overflow)
        if self.spikes is not None:
            spike = self.spikes.judge(agreed[2], norm, ~(fault | overflow))
        else:
            spike = torch.zeros_like(fault)
        skip = fault | spike
        self.pending.append(PendingStep(step, fault, local, loss, norm, overflow, spike, agreed[2]))
        self.fault_now = skip
        self._loss_bad = self._loss_sum = None
        return skip

    def skip_update(self, optimizer: Any, scaler: Any = None) -> None:
        """Make `optimizer.step()` a no-op when the step just closed is skipped, a fault or a spike (after clipping,
        before the step): through the fp16 loss `scaler`'s own `found_inf` when one drives the step, else `optimizer`'s
        (the torch optimizer inside accelerate's wrapper; see `skip.py`)."""
        fault = self.fault_now
        if fault is None:
            return
        skip_if_faulted(unwrap_optimizer(optimizer), scaler, fault)

    def after_update(self, optimizer: Any) -> None:
        """After `optimizer.step()`: remove the `found_inf` handed to a fused `optimizer`."""
        clear_found_inf(unwrap_optimizer(optimizer))

    def read(self) -> list[StepReading]:
        """The pending steps as [`StepReading`]s, in one device-to-host transfer (and, only when a step is bad, one
        collective naming the ranks whose loss was non-finite); the pending list is emptied."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        table = torch.stack(
            [torch.stack([p.fault, p.loss, p.grad_norm, p.overflow, p.spike, p.judged_loss]).float() for p in pending]
        ).cpu()
        bad = [bool(flag) for flag in table[:, 0].tolist()]
        losses, norms = table[:, 1].tolist(), table[:, 2].tolist()
        overflow, spike, judged = table[:, 3].tolist(), table[:, 4].tolist(), table[:, 5].tolist()
        ranks = ranks_with_flag(torch.stack([p.local for p in pending])) if any(bad) else [[] for _ in pending]
        return [
            StepReading(p.step, loss, norm, b, tuple(r), bool(o), bool(k), j)
            for p, loss, norm, b, r, o, k, j in zip(pending, losses, norms, bad, ranks, overflow, spike, judged)
        ]

    def clear(self) -> None:
        """Forget the pending steps and the step in progress (after a rollback, or at a new run's start)."""
        self.pending.clear()
        self._loss_bad = self._loss_sum = None


def hand_back(step: int, riding: Sequence[tuple[Any, torch.Tensor]], agreed: torch.Tensor, start: int) -> None:
    """Hand each rider of `riding` (`(rider, its local value)`, in the order they were appended to the all-reduce
    from element `start` of `agreed`) its agreed value: a 0-d bit as a bool tensor (the OR over ranks), a vector as
    the float32 slice of its elements (the maximum over ranks). Device tensors: nothing is read here."""
    index = start
    for rider, local in riding:
        if local.dim() == 0:
            rider.agreed(step, agreed[index] > 0)
            index += 1
        else:
            rider.agreed(step, agreed[index : index + local.numel()])
            index += local.numel()


def loss_scale(backend: Any) -> float | None:
    """The fp16 loss scaler's current scale (a host read; only at an inspection that found overflows): DeepSpeed's
    ZeRO optimizer's, or the `GradScaler` of [`Backend`] `backend`."""
    if backend is None:
        return None
    if backend.zero_stage is not None:
        optimizer = backend.optimizer
        scale = getattr(optimizer, "cur_scale", None) or getattr(optimizer, "loss_scale", None)
        return float(scale) if scale is not None else None
    scaler = backend.scaler
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None


__all__ = ["PendingStep", "StepFlags", "hand_back", "loss_scale"]
