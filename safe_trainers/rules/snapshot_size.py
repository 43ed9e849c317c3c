"""Host memory the NaN guard's snapshot needs, per rank and per node, estimated from the shape of a run: the estimate
the `memory.snapshot_fits` rule (`memory.py`) compares with the host memory available.

A snapshot ([`HostSnapshot`]) holds, in host memory (pinned on GPU machines), what the optimizer can change:

* without DeepSpeed (one GPU, DDP, FSDP2): every trainable parameter in its own dtype and the torch optimizer's
  state: AdamW's two moments per trainable parameter. Frozen parameters (a LoRA base) are checked, never copied;
* under DeepSpeed ZeRO (stages 1-3): this rank's partition of the optimizer: the fp32 master copy of the trainable
  parameters and AdamW's two fp32 moments. The 16-bit weights are not copied (a restore rebuilds them from the fp32
  master).

ZeRO and FSDP2 shard it over the data-parallel ranks, each rank copying only its own shard; under DDP, whose ranks hold
identical replicas, each rank keeps 1/N of one copy (`guard/rollback/replica_shards.py`). The tensors live in one
buffer per dtype, sized exactly (`runtime/host_buffers.py`), so these are the bytes held, pinned ones included. Step
counters (4 bytes per parameter tensor) are left out. Built from a trainer
(`rules/stages.py::snapshot_facts`), one process and DDP count each trainable parameter in its own dtype
(`RunShape.trainable_bytes`: a bf16 full fine-tune holds 6 bytes a parameter, not 10).

Example:
    ```python
    >>> from safe_trainers.rules.snapshot_size import RunShape, per_rank_bytes
    >>> per_rank_bytes(RunShape("7B LoRA", 7_000_000_000, 40_000_000, "fsdp2", world_size=8)) / 2**30
    0.0558...
    ```
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Strategy = Literal["single", "ddp", "fsdp2", "zero1", "zero2", "zero3"]
GIB = 2**30


@dataclass(frozen=True)
class Layout:
    """What one data-parallel strategy puts in a rank's snapshot.

    Args:
        sharded (`bool`): each rank holds `1 / world_size` of the state (ZeRO, FSDP2: its shard; DDP: its share of
            the replicas' one copy) instead of all of it (one process).
        model_weights (`bool`): the model's own trainable parameters are copied (everything but ZeRO).
        fp32_master (`bool`): the optimizer's fp32 master copy of the trainable parameters is copied (ZeRO).
    """

    sharded: bool
    model_weights: bool
    fp32_master: bool


LAYOUTS: dict[str, Layout] = {
    "single": Layout(sharded=False, model_weights=True, fp32_master=False),
    "ddp": Layout(sharded=True, model_weights=True, fp32_master=False),
    "fsdp2": Layout(sharded=True, model_weights=True, fp32_master=False),
    "zero1": Layout(sharded=True, model_weights=False, fp32_master=True),
    "zero2": Layout(sharded=True, model_weights=False, fp32_master=True),
    "zero3": Layout(sharded=True, model_weights=False, fp32_master=True),
}


@dataclass(frozen=True)
class RunShape:
    """The shape of a training run, as far as the snapshot's size depends on it.

    Args:
        name (`str`): how tables show the run (e.g. `"7B full"`).
        params (`int`): all parameters of the model being trained (the reference model is never snapshotted).
        trainable (`int`): the trainable ones (all of them for a full fine-tune, the adapters for LoRA).
        strategy (`str`): `"single"`, `"ddp"`, `"fsdp2"`, `"zero1"`, `"zero2"` or `"zero3"`.
        world_size (`int`): data-parallel ranks (GPUs).
        gpus_per_node (`int`): ranks per machine.
        weight_bytes (`int`): bytes per trainable parameter as the model stores it (4: fp32, as TRL loads a model by
            default and as FSDP2 keeps trainable parameters under mixed precision).
        moment_bytes (`int`): bytes per element of each of AdamW's two moments (4: fp32).
        trainable_bytes (`int | None`): the trainable parameters' bytes as the model holds them, each in its own
            dtype (a bf16 model, fp32 LoRA adapters next to a bf16 head). When given, the weights are these bytes and
            so is each of AdamW's two moments, which torch keeps in its parameter's dtype; `weight_bytes` and
            `moment_bytes` are then unused but under ZeRO (fp32 master and moments whatever the model's dtype).
    """

    name: str
    params: int
    trainable: int
    strategy: Strategy
    world_size: int = 1
    gpus_per_node: int = 8
    weight_bytes: int = 4
    moment_bytes: int = 4
    trainable_bytes: int | None = None

    @property
    def frozen(self) -> int:
        return self.params - self.trainable


def per_rank_bytes(run: RunShape) -> int:
    """Host bytes one rank's snapshot holds (see the module docstring for what it holds)."""
    if run.strategy not in LAYOUTS:
        raise ValueError(f"Unknown `strategy={run.strategy!r}`; choose one of {list(LAYOUTS)}.")
    layout = LAYOUTS[run.strategy]
    if run.trainable_bytes is not None and not layout.fp32_master:
        total = 3 * run.trainable_bytes  # the weights and AdamW's two moments, each in its parameter's dtype
        return math.ceil(total / run.world_size) if layout.sharded else total
    total = 2 * run.moment_bytes * run.trainable
    if layout.model_weights:
        total += run.weight_bytes * run.trainable
    if layout.fp32_master:
        total += 4 * run.trainable
    return math.ceil(total / run.world_size) if layout.sharded else total


def per_node_bytes(run: RunShape) -> int:
    """Host bytes the snapshots of one node's ranks hold together."""
    return per_rank_bytes(run) * min(run.world_size, run.gpus_per_node)


# 7B and 70B: nominal sizes. LoRA: rank 16 on every linear layer of the attention and MLP blocks, which is 40.0M
# adapter parameters for Llama-2-7B's shapes and 207M for Llama-2-70B's.
TYPICAL_MODELS = (("7B", 7_000_000_000, 40_000_000), ("70B", 70_000_000_000, 207_000_000))
TYPICAL_STRATEGIES: tuple[tuple[str, Strategy], ...] = (("DDP", "ddp"), ("ZeRO-3", "zero3"), ("FSDP2", "fsdp2"))
TYPICAL_WORLDS = (8, 64)


def typical_runs() -> list[tuple[str, str, str, list[RunShape]]]:
    """`(model, method, strategy, [the run on each of TYPICAL_WORLDS GPUs])` for the documented table."""
    rows = []
    for model, params, adapters in TYPICAL_MODELS:
        for method, trainable in (("full", params), ("LoRA", adapters)):
            for label, strategy in TYPICAL_STRATEGIES:
                runs = [
                    RunShape(f"{model} {method}", params, trainable, strategy, world_size=world)
                    for world in TYPICAL_WORLDS
                ]
                rows.append((model, method, label, runs))
    return rows


def _gib(value: int) -> str:
    return f"{value / GIB:,.1f}" if value >= GIB else f"{value / GIB:.2f}"


def memory_table() -> str:
    """The markdown table of docs/guard.md ("Memory") and the README: GiB of host memory per rank and per node (8 GPUs a
    node); strategies that need the same memory share a row."""
    header = ["model", "fine-tune", "strategy"]
    for world in TYPICAL_WORLDS:
        header += [f"per rank, {world} GPUs", f"per node, {world} GPUs"]
    rows: dict[tuple[str, ...], list[str]] = {}  # (model, method, figures...) -> strategies, in order
    for model, method, label, runs in typical_runs():
        figures = [cell for run in runs for cell in (_gib(per_rank_bytes(run)), _gib(per_node_bytes(run)))]
        rows.setdefault((model, method, *figures), []).append(label)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (2 * len(TYPICAL_WORLDS))]
    for (model, method, *figures), labels in rows.items():
        lines.append("| " + " | ".join([model, method, ", ".join(labels), *figures]) + " |")
    return "\n".join(lines)


__all__ = ["LAYOUTS", "Layout", "RunShape", "memory_table", "per_node_bytes", "per_rank_bytes", "typical_runs"]
