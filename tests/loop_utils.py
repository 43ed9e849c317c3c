"""A fake training loop around a [`NanGuard`], with no trainer: the guard's [`GuardPort`] over a tiny two-layer model,
a real fused `AdamW`, a `transformers.TrainerState` and the CPU. [`Loop.step`] plays one optimizer step through the
guard's doors in the order the integration layer calls them (`safe_trainers/trainer/hooks.py`, `callbacks.py`), with
faults fired at their steps; [`Loop.inspect`] plays one inspection as `trainer/inspection.py` does (judge, replay the
faulted step for its diagnosis, settle, restore), leaving out only what needs a trainer (loading and saving
checkpoints). A step takes about a millisecond."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from transformers import TrainerState

from safe_trainers.arguments import SafetyArguments
from safe_trainers.guard import Backend, Decision, EndRestore, NanGuard, localize
from safe_trainers.guard.port import Judged
from safe_trainers.runtime.events import EventLog

# Built once: the first `SafetyArguments()` imports the rule catalogue to validate `safety_disable_rules` (seconds).
DEFAULTS = SafetyArguments()
BATCH = 4  # rows per micro-batch
LEARNING_RATE = 1e-3

FaultKind = Literal["loss", "grad", "weight", "update"]


@dataclass
class FakePort:
    """The [`GuardPort`] of the fake loop: plain values the test reads and changes."""

    model: torch.nn.Module
    state: TrainerState
    scheduler: Any = None
    device: torch.device = torch.device("cpu")


class TinyNet(torch.nn.Module):
    """Two linear layers (`layers.0`, `layers.1`): the smallest model whose first non-finite module can be named."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](x)))


class Loop:
    """One guarded run of [`TinyNet`] on one fixed micro-batch per step.

    Args:
        output_dir (`Path`): the run's `output_dir` (the event log is written there).
        faults (`dict[int, str]`): the optimizer step (1-based, as `global_step` after it) -> the fault it fires:
            `"loss"` (the last layer outputs NaN on every grad-enabled forward of the step, the diagnosis replay at
            the inspection after it included: a NaN loss and NaN gradients), `"grad"` (the first weight's gradient
            gets an Inf), `"weight"` (a weight turns NaN before the step's forward), `"update"` (a weight turns NaN
            right after `optimizer.step()`, as a bad update would: the loss stays finite).
        **settings: `nan_*` settings over the defaults (`nan_snapshot_steps=2` at a fixed interval, as the guard
            tests' preset).
    """

    def __init__(self, output_dir: Path, faults: dict[int, FaultKind] | None = None, **settings: Any):
        torch.manual_seed(0)
        self.model = TinyNet()
        self.batch = {"x": torch.randn(BATCH, 4), "y": torch.randn(BATCH, 1)}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.port = FakePort(self.model, TrainerState(max_steps=8), scheduler)
        fixed = {"nan_snapshot_steps": 2, "nan_snapshot_budget": 0.0}
        self.settings = dataclasses.replace(DEFAULTS, **{**fixed, **settings})
        self.config = SimpleNamespace(learning_rate=LEARNING_RATE, output_dir=str(output_dir))
        self.events = EventLog(str(output_dir), write=True)
        self.guard = NanGuard(self.settings, self.config, self.port, self.events)
        self.faults = dict(faults or {})
        self.armed: FaultKind | None = None  # the fault of the step in progress (and of its replay)
        self.injected: list[tuple[int, str]] = []
        self.judged: Judged | None = None  # the last inspection's, before it was settled
        self.model.layers[-1].register_forward_hook(self._poison_activation)
        self.weight.register_hook(self._poison_grad)

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.model.layers[0].weight

    @property
    def global_step(self) -> int:
        return self.port.state.global_step

    # ---------------------------------------------------------------------------------------------- the doors
    def begin(self, rollback_from: str = "memory") -> bool:
        """`train()` then `on_train_begin`: a new run, bound to the optimizer. Returns `begin`'s answer (publish a
        starting checkpoint)."""
        self.guard.start_run(None, self.optimizer)
        return self.guard.begin(Backend(self.optimizer, None, False), rollback_from)

    def forward(self, record: bool = True) -> torch.Tensor:
        """The step's one micro-batch: its inputs recorded (`compute_loss`), the loss, its backward."""
        self.armed = self.faults.get(self.global_step + 1)
        if self.armed == "weight":
            self.poison_a_weight()
        self.model.train()
        if record:
            self.guard.record_inputs(self.batch)
        loss = self.loss(self.batch)
        loss.backward()
        return loss.detach()

    def clip(self) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def close(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The guard's hot path for a step whose loss is `loss`: returns the device skip flag."""
        self.guard.observe_loss(loss)  # `training_step`
        skip = self.guard.end_of_step(grad_norm)  # `_get_grad_norm`
        self.guard.apply_skip(self.optimizer)  # `on_pre_optimizer_step`, with:
        self.guard.snapshotter.before_write()
        return skip

    def update(self) -> None:
        with one_thread():
            self.optimizer.step()
        self.guard.after_update(self.optimizer)  # `on_optimizer_step`
        if self.armed == "update":
            self.poison_a_weight()
        self.optimizer.zero_grad(set_to_none=True)
        self.port.state.global_step += 1

    def step(self, record: bool = True) -> torch.Tensor:
        """One optimizer step; returns the device skip flag."""
        loss = self.forward(record)
        skip = self.close(loss, self.clip())
        self.update()
        return skip

    def inspect(self, verify: bool = False, snapshot: bool = False, fresh: bool = False) -> Decision | None:
        """One inspection: `judge`, the replay of a faulted step's batches (`localize`, as `trainer/replay.py`),
        `settle`, and on a restore decision `restore` (and `diverged` on an abort, with no checkpoint saved). `None`
        when there was nothing to judge."""
        guard = self.guard
        self.judged = judged = guard.judge(verify=verify, snapshot=snapshot, fresh=fresh)
        if judged is None:
            return None
        diagnosis = None
        if judged.replay:
            diagnosis = localize(self.model, judged.replay, self.loss, self.port.device)
            diagnosis.update(rank=0, step=judged.replay_step)
        decision = guard.settle(judged, diagnosis)
        if decision.restore:
            assert decision.load is None, "the fake loop loads no checkpoint"
            restored = guard.restore(decision)
            if decision.abort:
                raise guard.diverged(decision, restored, None)
        return decision

    def boundary(self, control: Any) -> Decision | None:
        """`on_step_end`: an inspection where one is due."""
        due = self.guard.due(control)
        return self.inspect(*due) if due is not None else None

    def finish(self) -> EndRestore | None:
        """After `train()` returns: the last check, and the restore of a state damaged after it."""
        end = self.guard.check_at_end(None)
        if end is not None:
            self.guard.restored_at_end(end)
        return end

    # ---------------------------------------------------------------------------------------------- faults
    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.model(batch["x"]), batch["y"])

    def poison_a_weight(self) -> None:
        with torch.no_grad():
            self.weight.view(-1)[0] = float("nan")
        self.injected.append((self.global_step + 1, self.armed or "weight"))

    def _poison_activation(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> Any:
        if self.armed == "loss" and torch.is_grad_enabled():
            return output * float("nan")
        return None

    def _poison_grad(self, grad: torch.Tensor) -> Any:
        if self.armed != "grad":
            return None
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny tensors on one thread: handing them to torch's thread pool costs more than the work (a fused AdamW step of
    [`TinyNet`] takes ~10 ms on two busy cores, 0.1 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
