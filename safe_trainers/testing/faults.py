"""Fault injection for testing the NaN guard: NaN/Inf in activations (hence the loss), gradients and weights.

`FaultInjector` is a `TrainerCallback`. Each fault fires at one optimizer step, optionally on one rank only:

```python
from .faults import Fault, FaultInjector

trainer.add_callback(FaultInjector([Fault(step=6, kind="loss"), Fault(step=9, kind="grad", rank=1)]))
```

Spikes (finite): `Fault(step=40, kind="loss_scale", value=100)` multiplies the step's training loss by 100 (so its
gradient too), which needs the trainer class to mix in [`LossScaleFaults`] (`build_trainer` does it when a fault asks
for it); `Fault(step=50, kind="grad_scale", value=1000)` multiplies the gradient flowing back through the last
decoder layer (every parameter below it) by 1000, the loss left as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import TrainerCallback

from ..guard import unwrap_optimizer
from ..runtime.sharding import is_sharded, local


FaultKind = Literal["loss", "grad", "weight", "update", "frozen", "loss_scale", "grad_scale"]


@dataclass(frozen=True)
class Fault:
    """One injected fault.

    Args:
        step (`int`): the optimizer step (1-based, the value `global_step` takes after it) the fault hits.
        kind (`str`): `"loss"` (the last decoder layer outputs NaN on the training forward, so the loss is NaN),
            `"grad"` (one trainable parameter's gradient becomes `value`), `"weight"` (one trainable weight is
            overwritten with `value` before the step, so the step's loss sees it), `"update"` (the same weight is
            overwritten right after the optimizer step, as a bad update would: the step's loss stays finite),
            `"frozen"` (one frozen weight matrix, a LoRA base layer say, is overwritten with `value` before the step),
            `"loss_scale"` (the training loss is multiplied by `value`: needs [`LossScaleFaults`]), `"grad_scale"`
            (the gradient flowing back through the last decoder layer is multiplied by `value`).
        rank (`int | None`): the only rank that injects (`None`: every rank).
        micro_batch (`int | None`): with `kind="loss"`, poison only this micro-batch of the step (0-based, among
            `gradient_accumulation_steps`); a replay of the step's micro-batches, in order, is poisoned the same way.
        value (`float`): the value injected (NaN by default; `float("inf")` for Inf).
        repeat (`int`): how many consecutive steps, starting at `step`, the fault hits. A fault fires `repeat` times
            in all: when a rollback makes the trainer pass the same step number again, it does not fire again.
    """

    step: int
    kind: FaultKind
    rank: int | None = None
    value: float = float("nan")
    repeat: int = 1
    micro_batch: int | None = None

    def hits(self, step: int, rank: int) -> bool:
        return self.step <= step < self.step + self.repeat and (self.rank is None or self.rank == rank)


class FaultInjector(TrainerCallback):
    """Injects the given faults during training (see module docstring). `injected` lists `(step, kind)` pairs."""

    def __init__(self, faults: list[Fault]):
        self.faults = list(faults)
        self.injected: list[tuple[int, str]] = []
        self._fired = [0] * len(self.faults)
        self._active: dict[str, float] = {}
        self._micro_batch: int | None = None
        self._forwards = 0
        self._accumulation = 1
        self._handles: list[Any] = []
        self._weight: torch.nn.Parameter | None = None
        self._frozen: torch.nn.Parameter | None = None
        self._step = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        layer = last_decoder_layer(model)
        param = first_trainable_matrix(model)
        self._handles = [layer.register_forward_hook(self._poison_activation), param.register_hook(self._poison_grad)]
        self._weight = param
        self._frozen = first_frozen_matrix(model) if any(f.kind == "frozen" for f in self.faults) else None
        self._accumulation = args.gradient_accumulation_steps

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        step = self._step = state.global_step + 1
        self._active, self._micro_batch, self._forwards = {}, None, 0
        for i, fault in enumerate(self.faults):
            if fault.hits(step, args.process_index) and self._fired[i] < fault.repeat:
                self._fired[i] += 1
                self._active[fault.kind] = fault.value
                if fault.kind == "loss":
                    self._micro_batch = fault.micro_batch
        if "weight" in self._active:
            self._poison_weight(optimizer, "weight")
        if "frozen" in self._active:
            with torch.no_grad():
                local(self._frozen.data).view(-1)[0] = self._active["frozen"]
            self.injected.append((self._step, "frozen"))

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if "update" in self._active:
            self._poison_weight(optimizer, "update")

    def _poison_weight(self, optimizer: Any, kind: str) -> None:
        with torch.no_grad():
            _weight_target(self._weight, optimizer).view(-1)[0] = self._active[kind]
        self.injected.append((self._step, kind))

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self._handles:
            handle.remove()

    def loss_factor(self) -> float:
        """The factor of an active `loss_scale` fault for the loss being computed now (`1.0`: none)."""
        if "loss_scale" not in self._active:
            return 1.0
        self.injected.append((self._step, "loss_scale"))
        return self._active["loss_scale"]

    def _poison_activation(self, module, inputs, output):
        if not torch.is_grad_enabled():
            return None
        if "grad_scale" in self._active:
            hidden = output if torch.is_tensor(output) else output[0]
            hidden.register_hook(self._scale_grad)
        if "grad" in self._active and is_sharded(self._weight):
            # FSDP2 hands a sharded parameter its gradient outside autograd (after the reduce-scatter), so the
            # parameter's own hook never fires: poison the gradient flowing back through this layer instead.
            hidden = output if torch.is_tensor(output) else output[0]
            hidden.register_hook(self._poison_grad)
        if "loss" not in self._active:
            return None
        index, self._forwards = self._forwards % self._accumulation, self._forwards + 1
        if self._micro_batch is not None and index != self._micro_batch:
            return None
        self.injected.append((self._step, "loss"))
        if torch.is_tensor(output):
            return output * self._active["loss"]
        return (output[0] * self._active["loss"], *output[1:])

    def _scale_grad(self, grad):
        self.injected.append((self._step, "grad_scale"))
        return grad * self._active["grad_scale"]

    def _poison_grad(self, grad):
        if "grad" not in self._active:
            return None
        self.injected.append((self._step, "grad"))
        grad = grad.clone()
        grad.view(-1)[0] = self._active["grad"]
        return grad


class LossScaleFaults:
    """Mixed in before a trainer class: its training loss is multiplied by the active `loss_scale` fault's value
    (read from `self.fault_injector`); evaluation losses are left alone."""

    fault_injector: FaultInjector | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        injector = self.fault_injector
        factor = injector.loss_factor() if injector is not None and model.training else 1.0
        if factor == 1.0:
            return result
        if return_outputs:
            loss, outputs = result
            return loss * factor, outputs
        return result * factor


def with_loss_faults(trainer_cls: type) -> type:
    """`trainer_cls` with [`LossScaleFaults`] mixed in (the class itself if it already has it)."""
    if issubclass(trainer_cls, LossScaleFaults):
        return trainer_cls
    return type(trainer_cls.__name__, (LossScaleFaults, trainer_cls), {})


def _weight_target(param: torch.nn.Parameter, optimizer: Any) -> torch.Tensor:
    """Where the weight really lives: under DeepSpeed ZeRO, this rank's fp32 master partition (the 16-bit copy is
    rewritten from it at every step); under FSDP2, this rank's shard of the parameter; otherwise the parameter."""
    zero = unwrap_optimizer(optimizer)
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        flats = [t for t in getattr(zero, name, []) if t.numel() > 0]
        if flats:
            return flats[0]
    return local(param.data)  # FSDP2: this rank's shard


def last_decoder_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The last `...layers.N` module of a transformers model (works through PEFT and DeepSpeed wrappers)."""
    layers = [(name, module) for name, module in model.named_modules() if re.search(r"layers\.\d+$", name)]
    if not layers:
        raise ValueError(f"No decoder layer (`...layers.N`) found in {type(model).__name__}.")
    return layers[-1][1]


def first_trainable_matrix(model: torch.nn.Module) -> torch.nn.Parameter:
    """The first trainable weight matrix outside the embeddings (every token's forward pass goes through it)."""
    candidates = [p for n, p in model.named_parameters() if p.requires_grad and "embed" not in n]
    for param in candidates:
        if param.dim() >= 2 or getattr(param, "ds_shape", ()) and len(param.ds_shape) >= 2:
            return param
    if candidates:
        return candidates[0]
    raise ValueError(f"{type(model).__name__} has no trainable parameter.")


def first_frozen_matrix(model: torch.nn.Module) -> torch.nn.Parameter:
    """The first frozen weight matrix outside the embeddings (a LoRA base layer of a PEFT model)."""
    for name, param in model.named_parameters():
        if not param.requires_grad and "embed" not in name and param.dim() >= 2:
            return param
    raise ValueError(f"{type(model).__name__} has no frozen weight matrix.")
