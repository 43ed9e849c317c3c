"""Diagnosis of a fault: keep host copies of the recent micro-batches, replay them with forward hooks, and name the
first module whose output went non-finite. The guard keeps the batches and hands those of a faulted step back
([`Judged.replay`]); the integration layer replays them through the trainer's own loss (`trainer/replay.py`) with
[`localize`]."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..runtime.finite import any_nonfinite
from ..runtime.host_arena import HostArena
from ..runtime.nested import map_tensors, tensors


class RecentBatches:
    """Host copies of the micro-batches of the steps not yet inspected, so a fault can be replayed.

    The copies are queued without blocking (device-to-host into one pinned buffer per dtype on GPU, reused from one
    inspection to the next: [`HostArena`]), so the guard keeps no device tensor alive past its step; they are dropped
    at each inspection. Host memory: the inputs of at most `nan_snapshot_steps` x `gradient_accumulation_steps`
    micro-batches (token ids and masks for text). On the CPU the inputs themselves are kept, not copied.
    """

    def __init__(self):
        self._steps: dict[int, list[Any]] = {}
        self._current: list[Any] = []
        self._dropped = False
        self.dropped: set[int] = set()  # poisoned steps: their batches as the dataloader gave them, never replayed
        self.host = HostArena()

    def record(self, inputs: Any, dropped: bool = False) -> None:
        """Keep `inputs`; `dropped`: the micro-batch of a poisoned step, not trained (kept for its replay bundle
        only, as the dataloader gave it: not prepared by the trainer)."""
        self._current.append(map_tensors(inputs, self._to_host))
        self._dropped = self._dropped or dropped

    def end_step(self, step: int) -> None:
        self._steps[step] = self._current
        if self._dropped:
            self.dropped.add(step)
        self._current, self._dropped = [], False

    def get(self, step: int | None) -> list[Any]:
        """The micro-batches of `step` to replay for its diagnosis (none for a poisoned step: they killed the
        process)."""
        return self._steps.get(step, []) if step is not None and step not in self.dropped else []

    def bundles(self, steps: list[int]) -> tuple[dict[int, list[Any]], set[int]]:
        """Every micro-batch kept for each of `steps` that has any, poisoned steps' included (for their replay
        bundles), and which of those steps were poisoned."""
        kept = {step: self._steps[step] for step in steps if self._steps.get(step)}
        return kept, kept.keys() & self.dropped

    def clear(self) -> None:
        self._steps.clear()
        self.dropped.clear()
        self._current, self._dropped = [], False
        self.host.reset()

    def nbytes(self) -> int:
        """Host bytes held: the pinned buffers on GPU, the inputs kept on the CPU (the current step's included)."""
        kept = [t for b in [*self._steps.values(), self._current] for t in tensors(b) if t.device.type == "cpu"]
        return self.host.nbytes() + sum(t.numel() * t.element_size() for t in kept if not self.host.holds(t))

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy queued on the current stream (pinned destination, so the copy never blocks the host); it is
        read only after an inspection's device-to-host transfer, which follows it on the same stream."""
        tensor = tensor.detach()
        return tensor if tensor.device.type == "cpu" else self.host.copy(tensor)


def first_nonfinite_module(model: torch.nn.Module, replay: Callable[[], Any]) -> dict[str, Any]:
    """Run `replay()` (the training forward over one micro-batch) with a forward hook on every module of `model`.

    Returns:
        `{"module": name, "type": class name, "input_finite": bool, "rows": [...]}` for the first module, in
        execution order, whose output contains NaN or Inf (`rows`: [`nonfinite_rows`] of that output);
        `{"module": None, "loss_finite": bool}` when every module output is finite; `{"module": None, "reason": ...}`
        when the replay itself failed.
    """
    found: dict[str, Any] = {}
    names = {module: name for name, module in model.named_modules()}

    def hook(module, inputs, output):
        if not found and any_nonfinite(output):
            found.update(module=names.get(module, type(module).__name__), type=type(module).__name__)
            found["input_finite"] = not any_nonfinite(inputs)
            found["rows"] = nonfinite_rows(output)

    handles = [module.register_forward_hook(hook) for module in model.modules()]
    try:
        # Grad mode on, as in the training forward that failed (some code paths differ under no_grad).
        with torch.enable_grad():
            loss = replay()
    except Exception as error:  # the replay is diagnostic only: never let it break training
        if not found:
            return {"module": None, "reason": f"replay failed: {type(error).__name__}: {error}"[:300]}
        return found
    finally:
        for handle in handles:
            handle.remove()
    return found or {"module": None, "loss_finite": not any_nonfinite(loss)}


# The most row indices a diagnosis lists (a whole batch gone non-finite is listed up to this many).
MAX_ROWS = 64


def nonfinite_rows(output: Any) -> list[int]:
    """The batch rows (indices along the first dimension) holding NaN or Inf in the first tensor of `output` that
    does, at most [`MAX_ROWS`]; `[]` for a scalar. Which input rows carried the fault into this module: a DPO forward
    stacks the chosen completions, then the rejected ones (rows `B..2B-1` are the rejected of rows `0..B-1`)."""
    for tensor in tensors(output):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            if tensor.dim() == 0:
                return []
            bad = ~torch.isfinite(tensor.detach()).reshape(tensor.shape[0], -1).all(dim=1)
            return [int(i) for i in bad.nonzero().flatten()[:MAX_ROWS]]
    return []


def localize(model: torch.nn.Module, micro_batches: list[Any], replay: Callable[[Any], Any], device: Any) -> dict:
    """Replay the micro-batches of one step in order; report the first whose forward pass or loss went non-finite.

    Every micro-batch is replayed, even after a finding, so that all ranks run the same number of forward passes
    (and of the collectives inside them: ZeRO-3 gathers, TRL's metric gathers) whichever rank went non-finite.

    Returns the [`first_nonfinite_module`] result of that micro-batch plus `micro_batch` (its index in the step) and
    `micro_batches` (how many the step had); when all were finite, the reason says the backward pass was the culprit.
    """
    found = None
    for index, batch in enumerate(micro_batches):
        on_device = map_tensors(batch, lambda t: t.to(device, non_blocking=True))
        result = first_nonfinite_module(model, lambda: replay(on_device))
        if found is None and (result.get("module") or result.get("reason") or not result.get("loss_finite", True)):
            if result.get("module") is None and "reason" not in result:
                result["reason"] = "every module output was finite; the loss computation was not"
            result.pop("loss_finite", None)
            found = {**result, "micro_batch": index, "micro_batches": len(micro_batches)}
    return found or {
        "module": None,
        "reason": "every module output and loss of the step's micro-batches was finite; the backward pass or the "
        "gradients were not",
        "micro_batches": len(micro_batches),
    }
