"""Memory rules (`memory.*`): the NaN guard's host copy of the training state, and a background save's, must fit in
host memory."""

from __future__ import annotations

from .base import Rule
from .report import Change, Finding

# The share of the host memory available at construction the snapshots of one node may take: the training processes
# need the rest (data loading, pinned buffers, checkpoint writing, which gathers state on the host too).
HOST_MEMORY_SHARE = 0.5
GIB = 2**30


def save_strategy(args) -> str:
    """`args.save_strategy` as a string (it is a string, or transformers' `SaveStrategy` enum); `"steps"` when unset."""
    strategy = getattr(args, "save_strategy", "steps")
    return str(getattr(strategy, "value", strategy))


def saves_nothing(args) -> bool:
    """`save_strategy="no"`."""
    return save_strategy(args) == "no"


class SnapshotFits(Rule):
    """The NaN guard's host copy of the training state must fit in host memory, or it rolls back from disk.

    What it changes:
        `nan_rollback_from` becomes `"checkpoint"` (the guard keeps no host copy and a rollback reloads the newest
        verified checkpoint) when the snapshots of one node, estimated from the model, its trainable parameters, the
        distributed strategy and the number of ranks per node, would take more than half the host memory available
        when the trainer is built. Applied to the guard's settings (`trainer.safety_settings`), not to your config: the
        guard reads its source there (`NanGuard.rollback_from`) and, when training starts, logs it next to the
        configured one.

    Why:
        a full fine-tune keeps weights plus two Adam moments per trainable parameter, about 84 GB of host memory
        per node for a 7B model (the state per parameter: [ZeRO, section 3.1](https://arxiv.org/abs/1910.02054)): one
        copy per node under DDP (its ranks share it out), less under ZeRO and FSDP2 over several nodes. A process
        killed by the out-of-memory killer loses more than a NaN would (docs/guard.md, "Memory").

    Opt out:
        `safety_disable_rules=["memory.snapshot_fits"]` keeps the host copy; `nan_rollback_from="checkpoint"` chooses
        the disk yourself; `nan_guard=False` turns the guard off.
    """

    id = "memory.snapshot_fits"
    summary = "The NaN guard's host snapshot must fit in host memory, else it rolls back from the newest checkpoint."
    rationale = "https://arxiv.org/abs/1910.02054"  # ZeRO, section 3.1: Adam keeps 12-16 bytes per parameter

    def check_built(self, built) -> Finding | None:
        args = built.args
        if not getattr(args, "nan_guard", True) or getattr(args, "nan_rollback_from", "memory") != "memory":
            return None
        if built.snapshot_bytes_per_node is None or built.host_memory_available is None:
            return None
        need, available = built.snapshot_bytes_per_node, built.host_memory_available
        no_saves = saves_nothing(args)
        if need <= HOST_MEMORY_SHARE * available:
            return None
        return self.fixed(
            f"The NaN guard's host copy of the weights and optimizer state needs about {need / GIB:,.1f} GiB per node "
            f"({built.snapshot_strategy}), more than half of the {available / GIB:,.1f} GiB of host memory available: "
            "it now rolls back to the newest verified checkpoint instead (`nan_rollback_from=\"checkpoint\"`: no "
            "host copy, a slower restore, the steps since that checkpoint are discarded). Save often enough "
            "(`save_steps`) for that to cost little"
            + (", since with `save_strategy=\"no\"` a rollback goes back to the start" if no_saves else "")
            + ", or free host memory and set `safety_disable_rules=[\"memory.snapshot_fits\"]`.",
            Change("safety_settings.nan_rollback_from", "memory", "checkpoint"),
            needed_bytes=need,
            available_bytes=available,
        )

    def apply_built(self, trainer, finding: Finding) -> None:
        trainer.safety_settings.nan_rollback_from = "checkpoint"


class SaveCopyFits(Rule):
    """A background save's host copy of the state must fit in host memory beside the guard's snapshot, or saves are
    written synchronously.

    What it changes:
        `save_in_background` becomes `False` (each checkpoint is written before training goes on, as in TRL) when
        the copy a background save makes of the weights it writes (a PEFT model's adapters only) and the optimizer's
        moments, with the guard's snapshot when it is kept in memory, would take more than half the host memory
        available when the trainer is built. Applied to the guard's settings (`trainer.safety_settings`), not to
        your config.

    Why:
        a background save copies the state to host memory so that training can go on while the files are written:
        for a 7B full fine-tune that is ~100 GB on top of the snapshot's ~84 GB. A process killed by the
        out-of-memory killer loses more than the time a synchronous save blocks.

    Opt out:
        `safety_disable_rules=["memory.save_copy_fits"]` keeps background saves; `save_in_background=False` turns
        them off yourself.
    """

    id = "memory.save_copy_fits"
    summary = "A background save's host copy must fit in host memory beside the snapshot, else saves are synchronous."
    rationale = "https://pytorch.org/blog/reducing-checkpointing-times/"  # staging to host memory, then writing

    def check_built(self, built) -> Finding | None:
        args = built.args
        if not getattr(args, "nan_guard", True) or not getattr(args, "save_in_background", True):
            return None
        if built.save_copy_bytes is None or built.host_memory_available is None:
            return None
        if saves_nothing(args):
            return None
        share = HOST_MEMORY_SHARE * built.host_memory_available
        snapshot = built.snapshot_bytes_per_node or 0
        in_memory = getattr(args, "nan_rollback_from", "memory") == "memory" and snapshot <= share
        need = built.save_copy_bytes + (snapshot if in_memory else 0)
        if need <= share:
            return None
        return self.fixed(
            f"A background save copies the weights and optimizer state to host memory (about "
            f"{built.save_copy_bytes / GIB:,.1f} GiB"
            + (f", beside the NaN guard's {snapshot / GIB:,.1f} GiB snapshot" if in_memory else "")
            + f"), more than half of the {built.host_memory_available / GIB:,.1f} GiB of host memory available: "
            "checkpoints are now written before training goes on (`save_in_background=False`), as in TRL. Free host "
            "memory and set `safety_disable_rules=[\"memory.save_copy_fits\"]` to keep background saves.",
            Change("safety_settings.save_in_background", True, False),
            needed_bytes=need,
            available_bytes=built.host_memory_available,
        )

    def apply_built(self, trainer, finding: Finding) -> None:
        trainer.safety_settings.save_in_background = False
