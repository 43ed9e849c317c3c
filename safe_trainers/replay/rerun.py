"""A bundle replayed on the CPU: TRL's trainer of the run's kind rebuilt from the checkpoint before the step and the
run's config, the bundle's non-finite state entries written over its weights, the test faults that fired re-armed,
and the step's micro-batches run through the trainer's own `compute_loss` with forward hooks on every module
([`localize`]): the first module whose output went non-finite, and which rows (docs/replay.md). A bundle without
micro-batches (a rollback the check of the state found with no faulted step, or every micro-batch over the bound)
has no forward to run: the checkpoint is loaded and the non-finite entries written over it, and the replay says so."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any

import torch

from ..guard.diagnosis import localize
from ..kinds import get_kind
from ..restarts.checkpoint_choice import WEIGHT_FILES, WEIGHT_INDEXES
from ..runtime.checkpoint_dirs import checkpoint_step, checkpoints
from .bundle import read_bundle

# One row of the trainer's data format: TRL's constructors require a training set, which the replay never reads.
PLACEHOLDER_ROWS: dict[str, dict[str, Any]] = {
    "preference": {"prompt": "a", "chosen": " b", "rejected": " c"},
    "prompt_completion": {"prompt": "a", "completion": " b"},
    "unpaired": {"prompt": "a", "completion": " b", "label": True},
    "prompt": {"prompt": "a"},
}
# Config fields set for the replay whatever the run used: one CPU process, nothing written, no backend wrapper.
REPLAY_CONFIG: dict[str, Any] = {
    "use_cpu": True, "fp16": False, "report_to": "none", "save_strategy": "no", "eval_strategy": "no",
    "push_to_hub": False, "load_best_model_at_end": False, "deepspeed": None, "fsdp": "", "fsdp_config": None,
    "torch_compile": False, "use_vllm": False, "hub_token": None,
}  # fmt: skip
# Fields a config derives from others in `__post_init__`, refused when given with them: left to be derived again.
DERIVED_FIELDS = frozenset({"generation_batch_size"})
# The test faults whose effect a forward pass shows and no state holds: re-armed. Those that wrote the state
# (`weight`, `frozen`, `update`) are replayed from the non-finite entries they left, as a real fault would be; those
# that act on the backward (`grad`, `grad_scale`) or scale a finite loss (`loss_scale`) show in no forward.
FORWARD_FAULTS = frozenset({"loss"})


@dataclass
class Replayed:
    """What a replay found.

    Args:
        step (`int`): the step replayed.
        meta (`dict`): the bundle's `meta.json`.
        checkpoint (`str`): the checkpoint directory the replay started from.
        found (`dict`): the [`localize`] result of the replay (`module`, `type`, `rows`, `micro_batch`, ...).
        rearmed (`list[dict]`): the test faults re-armed.
        overlaid (`list[str]`): the state entries written over the checkpoint's weights.
        not_rearmed (`list[dict]`): the test faults that fired at the step but act on no forward pass (or, with no
            forward to run, all of them).
        state (`dict`): the bundle's non-finite state entries (name: shape, dtype, flat indices and values).
        forward (`bool`): whether a forward ran: `False` for a bundle without micro-batches, or a poisoned GRPO/RLOO
            step's (prompts only) (`found["reason"]` says why).
    """

    step: int
    meta: dict[str, Any]
    checkpoint: str
    found: dict[str, Any]
    rearmed: list[dict[str, Any]] = field(default_factory=list)
    overlaid: list[str] = field(default_factory=list)
    not_rearmed: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, dict[str, Any]] = field(default_factory=dict)
    forward: bool = True


def checkpoint_before(output_dir: str, step: int) -> str | None:
    """The newest `checkpoint-K` directory of `output_dir` with `K < step`, or `None`."""
    found = [(checkpoint_step(path), path) for path in checkpoints(output_dir)]
    earlier = [(s, path) for s, path in found if s is not None and s < step]
    return max(earlier)[1] if earlier else None


def loadable_weights(checkpoint: str) -> bool:
    """Whether `checkpoint` holds model weights `from_pretrained` loads (a DeepSpeed ZeRO-3 or FSDP sharded save
    may hold only its engine's shards)."""
    return any(os.path.isfile(os.path.join(checkpoint, name)) for name in WEIGHT_FILES + WEIGHT_INDEXES)


def replay(output_dir: str, step: int, checkpoint: str) -> Replayed:
    """Replay step `step`'s bundle of `output_dir` on the CPU from `checkpoint` (see the module docstring)."""
    meta, args, payload = read_bundle(output_dir, step)
    kind = get_kind(meta["kind"])
    if not meta.get("prepared", True) and kind.online:
        found = {"module": None, "reason": "a poisoned GRPO/RLOO step holds its prompts only: its completions were "
                 "never generated, so there is no training forward to replay"}  # fmt: skip
        return Replayed(step, meta, checkpoint, found, forward=False)
    with tempfile.TemporaryDirectory(prefix="safe-trainers-replay-") as work:
        trainer = rebuild_trainer(kind, checkpoint, args, work)
        model = trainer.model
        model.train()
        state = payload.get("state") or {}
        overlaid = overlay(model, state)
        faults = payload.get("faults", meta.get("faults", []))  # the replayed rank's (the meta's: the main's)
        kept = payload["micro_batches"]
        if not kept:
            found = {"module": None, "reason": no_forward_reason(meta)}
            return Replayed(step, meta, checkpoint, found, [], overlaid, list(faults), state, forward=False)
        rearmed = [f for f in faults if f["kind"] in FORWARD_FAULTS]
        injector = rearm(trainer, rearmed, step)
        indices = sorted(kept)
        # A poisoned step's batches are the dataloader's: for an offline kind, what `compute_loss` receives but for
        # the move to the device, which `localize` makes.
        batches = [kept[i] for i in indices]
        try:
            found = localize(model, batches, lambda batch: trainer.compute_loss(model, batch), torch.device("cpu"))
        finally:
            if injector is not None:
                injector.on_train_end(trainer.args, None, None)
        if "micro_batch" in found:  # its index among the step's micro-batches (some may have been left out)
            found["micro_batch"] = indices[found["micro_batch"]]
        found["micro_batches"] = meta.get("micro_batches", len(indices))
    not_rearmed = [f for f in faults if f["kind"] not in FORWARD_FAULTS]
    return Replayed(step, meta, checkpoint, found, rearmed, overlaid, not_rearmed, state)


def no_forward_reason(meta: dict[str, Any]) -> str:
    """Why a bundle without micro-batches has no forward to replay, in words (from its `meta.json`)."""
    if meta.get("found_by") == "state_check":
        return ("the bundle holds no micro-batches: the guard's check of the state found it non-finite with no "
                "step's loss or gradient non-finite, so which step damaged it is unknown")  # fmt: skip
    if meta.get("left_out"):
        return "every micro-batch of the step was left out of the bundle (over `nan_replay_max_bytes`)"
    return "the bundle holds no micro-batches"


def rebuild_trainer(kind: Any, checkpoint: str, run_args: dict[str, Any], work_dir: str) -> Any:
    """TRL's trainer of `kind` on the weights of `checkpoint`, with the run's config (`run_args`) set for one CPU
    process writing nothing but to `work_dir`. Its training set is one placeholder row ([`PLACEHOLDER_ROWS`]); an
    online trainer's reward function scores nothing (the bundle's inputs carry their advantages); a reference
    model, where the trainer makes one, is built from the same checkpoint (its forward is not where a policy's
    fault shows)."""
    import datasets

    config_cls = kind.trl_config
    names = {f.name for f in fields(config_cls) if f.init}
    settings = {
        k: v for k, v in run_args.items() if k in names and k not in DERIVED_FIELDS and v != f"<{k.upper()}>"
    }
    settings.update({k: v for k, v in REPLAY_CONFIG.items() if k in names}, output_dir=work_dir)
    config = config_cls(**settings)
    extra: dict[str, Any] = {}
    if kind.online:
        extra["reward_funcs"] = _no_reward
    data = datasets.Dataset.from_list([PLACEHOLDER_ROWS[kind.data_format]] * 2)
    return kind.trl_trainer(model=policy(checkpoint), args=config, train_dataset=data, **extra)


def policy(checkpoint: str) -> Any:
    """What the trainer gets as `model`: the checkpoint's path, or for a PEFT run's checkpoint (an adapter, no
    `config.json`) the adapter loaded trainable on its base model (`base_model_name_or_path`), so that its modules
    and parameters have the run's names (`base_model.model...`), those of the bundle's state and diagnosis."""
    if os.path.isfile(os.path.join(checkpoint, "config.json")) or not os.path.isfile(
        os.path.join(checkpoint, "adapter_config.json")
    ):
        return checkpoint
    from peft import AutoPeftModel

    return AutoPeftModel.from_pretrained(checkpoint, is_trainable=True)


def _no_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


def overlay(model: torch.nn.Module, state: dict[str, dict[str, Any]]) -> list[str]:
    """Write each bundle entry's non-finite values over the parameter or buffer of that name; returns the names
    written (an entry of a shard, or of a name the model lacks, is passed over)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    written = []
    with torch.no_grad():
        for name, entry in state.items():
            target = tensors.get(name)
            if target is None or entry.get("shard") or list(target.shape) != list(entry["shape"]):
                continue
            target.view(-1)[entry["index"]] = entry["value"].to(target.dtype)
            written.append(name)
    return written


def rearm(trainer: Any, faults: list[dict[str, Any]], step: int) -> Any:
    """Attach the test tool's `FaultInjector` with `faults` (as the bundle wrote them), armed for `step` on this
    process; `None` without faults."""
    if not faults:
        return None
    from ..testing.faults import Fault, FaultInjector

    kinds = {f.name for f in fields(Fault)}
    armed = [Fault(**{**{k: v for k, v in f.items() if k in kinds}, "value": float(f["value"]), "rank": None})
             for f in faults]  # fmt: skip
    injector = FaultInjector(armed)
    injector.on_train_begin(trainer.args, None, None, model=trainer.model)
    injector.on_step_begin(trainer.args, SimpleNamespace(global_step=step - 1), None, optimizer=None)
    return injector


__all__ = [
    "FORWARD_FAULTS", "Replayed", "checkpoint_before", "loadable_weights", "no_forward_reason", "rebuild_trainer",
    "replay",
]  # fmt: skip
