"""How a faulted step is kept out of the weights, and what is cleaned up after `optimizer.step()`.

The route is chosen from two facts, the loss scaler and the optimizer ([`skip_route`], a table):

- `"scaler"`: an fp16 `torch.amp.GradScaler` drives the step. The fault is folded into the scaler's own record of
  non-finite gradients for this optimizer (the `found_inf` tensors `GradScaler.unscale_` leaves for `step` and
  `update`), on the device: the scaler skips the step as it skips an overflow, with no host read of the guard's own
  (a non-fused optimizer's `GradScaler.step` reads its record on the host, as in stock fp16 training). A step with
  no gradient at all (a poisoned step, whose batches are not trained: see `restarts/step_progress.py`) leaves that
  record empty, which `GradScaler.step` and `GradScaler.update` refuse ("No inf checks were recorded"): the guard
  writes the record itself then. Like any overflow, the skipped step lowers the scale once; with a non-fused
  optimizer accelerate reports the step skipped, so the LR schedule holds for that step, as for an overflow in stock
  fp16 training.
- `"found_inf"`: a fused torch optimizer (`_step_supports_amp_scaling`) and no scaler: the flag is handed to the
  optimizer as its `found_inf`, which skips the update on the device and undoes its step count; the attribute is
  removed again after the step ([`clear_found_inf`]), so no later step and no pickled optimizer carries it.
- `"drop_grads"`: any other optimizer: one host read of the flag, and on a fault the gradients are dropped.

The scaler's per-optimizer record and stage are read through `GradScaler`'s private `_found_inf_per_device` and
`_per_optimizer_states` (unchanged from torch 1.6 to 2.13); `tests/guard/test_guard_loss_scaler.py` pins them with a
real `GradScaler`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.amp.grad_scaler import OptState

SkipRoute = Literal["scaler", "found_inf", "drop_grads"]

# (an enabled fp16 loss scaler drives the step, the optimizer skips on the device) -> route
ROUTES: dict[tuple[bool, bool], SkipRoute] = {
    (True, True): "scaler",
    (True, False): "scaler",
    (False, True): "found_inf",
    (False, False): "drop_grads",
}


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside accelerate's `AcceleratedOptimizer` (`trainer.optimizer`), or `optimizer` itself when it
    wraps none (`None` stays `None`)."""
    return getattr(optimizer, "optimizer", optimizer)


def skip_route(scaled: bool, fused: bool) -> SkipRoute:
    """How a faulted step is skipped: `scaled`, an enabled loss scaler drives `optimizer.step()`; `fused`, the
    optimizer takes a device `found_inf` flag (see the module docstring)."""
    return ROUTES[(scaled, fused)]


def route_for(optimizer: Any, scaler: Any) -> SkipRoute:
    """[`skip_route`] for a torch optimizer (accelerate's wrapper unwrapped) and the accelerator's scaler, if any."""
    scaled = scaler is not None and scaler.is_enabled()
    return skip_route(scaled, bool(getattr(optimizer, "_step_supports_amp_scaling", False)))


def fold_into_scaler(optimizer: Any, fault: torch.Tensor, scaler: Any) -> None:
    """Add the device flag `fault` to `scaler`'s record of non-finite gradients for `optimizer`, so that the scaler
    skips the step (no host read). Records the checks first when `unscale_` has not run this step (no clipping and no
    norm); writes the record when there was no gradient to check (a poisoned step)."""
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    record = scaler._found_inf_per_device(optimizer)
    flag = fault.detach().to(torch.float32)
    if not record:
        record[flag.device] = torch.zeros((), dtype=torch.float32, device=flag.device)
    # A fused optimizer gets the sum of the devices' records and skips on exactly 1 (and subtracts it from its step
    # counts): the fault goes into one record only, and only when no other device has recorded an overflow already.
    first, *others = record.values()
    flag = flag.to(first.device, non_blocking=True)
    if others:
        seen = torch.stack([found.to(first.device, non_blocking=True) for found in others]).amax() > 0
        flag = flag * ~seen
    torch.maximum(first, flag, out=first)


def set_found_inf(optimizer: Any, fault: torch.Tensor, scaler: Any = None) -> None:
    """Hand the flag to a fused optimizer, which skips the update on the device (removed by [`clear_found_inf`]).
    `scaler` is unused (one signature for the [`ACTIONS`] table), as in [`drop_grads`]."""
    optimizer.found_inf = fault.detach().to(torch.float32)


def drop_grads(optimizer: Any, fault: torch.Tensor, scaler: Any = None) -> None:
    """One host read of the flag; on a fault, drop every gradient so that `optimizer.step()` changes nothing."""
    if bool(fault):
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None


def clear_found_inf(optimizer: Any) -> None:
    """Remove the `found_inf` [`set_found_inf`] handed to `optimizer` (after its step)."""
    if "found_inf" in vars(optimizer):
        del optimizer.found_inf


def skip_if_faulted(optimizer: Any, scaler: Any, fault: torch.Tensor) -> SkipRoute:
    """Make `optimizer.step()` (as accelerate drives it, through `scaler` when there is one) skip the update when the
    device flag `fault` is set; returns the route taken. `optimizer`: the torch optimizer, accelerate's wrapper
    unwrapped."""
    route = route_for(optimizer, scaler)
    ACTIONS[route](optimizer, fault, scaler)
    return route


ACTIONS: dict[SkipRoute, Callable[[Any, torch.Tensor, Any], None]] = {
    "scaler": fold_into_scaler,
    "found_inf": set_found_inf,
    "drop_grads": drop_grads,
}


__all__ = [
    "ACTIONS", "ROUTES", "SkipRoute", "clear_found_inf", "drop_grads", "fold_into_scaler", "route_for",
    "set_found_inf", "skip_if_faulted", "skip_route",
]  # fmt: skip
