"""The trainers' two rule stages, one entry each, used by the safe trainers, `safe-trainers check` and the tests.

1. `run_setup_rules`: before any weight is loaded, on the [`TrainerSetup`]; fixes give a new setup (`apply_to_setup`).
2. `run_built_rules`: after TRL's constructor, on the built trainer ([`BuiltTrainer`] view); each fix is carried out
   in place by the rule that found it ([`Rule.apply_built`]).

The engine (`engine.py`) decides what is raised, reported and applied; these entries give it the actions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..arguments import SafetyArguments
from ..errors import SafetyError
from . import DEFAULT_RULES, BuiltTrainer, Rule
from .apply import apply_to_setup
from .context import TrainerSetup
from .engine import new_report, run_stage, select_rules
from .report import Finding, SafetyReport


def run_setup_rules(
    setup: TrainerSetup,
    settings: SafetyArguments,
    *,
    rules: Iterable[Rule] = DEFAULT_RULES,
    raise_blocked: bool = True,
) -> tuple[TrainerSetup, SafetyReport]:
    """Run the construction-time rules of `setup.kind` and return the (fixed) setup and the report.

    Args:
        setup ([`TrainerSetup`]): what the trainer is about to be built from.
        settings ([`SafetyArguments`]): `safety_mode` and `safety_disable_rules`.
        rules (`Iterable[Rule]`, *optional*): the rule set (default: every built-in rule).
        raise_blocked (`bool`, *optional*, defaults to `True`): raise [`SafetyError`] for blocked findings (and every
            finding in `"strict"` mode); `False` records them in the report instead (`safe-trainers check`).
    """
    enabled, disabled = select_rules(setup.kind, settings, rules)
    report = new_report(setup.kind, settings, disabled)
    report.notes += setup.assumptions
    if settings.safety_mode == "off":
        return setup, report
    try:
        setup = run_stage(setup, enabled, settings.safety_mode, report, check=_check_setup, apply=apply_to_setup)
    except SafetyError as error:
        if raise_blocked:
            raise
        report.findings.extend(error.findings)
    return setup, report


def run_built_rules(
    trainer: Any,
    settings: SafetyArguments,
    report: SafetyReport,
    source_rows: int | None = None,
    *,
    rules: Iterable[Rule] = DEFAULT_RULES,
) -> None:
    """Run the rules that need the loaded model or the tokenized data on a built safe trainer, recording them in
    `report`; each fix is applied to the trainer, in place, by its rule's `apply_built`. `source_rows`: the training
    set's size as passed, before TRL's preprocessing; `rules`: the rule set (default: every built-in rule)."""
    if settings.safety_mode == "off":
        return
    enabled, _ = select_rules(trainer.safety_kind, settings, rules)
    owners = {rule.id: rule for rule in enabled}
    facts = snapshot_facts(trainer)  # once: it measures the machine and agrees across ranks

    def check(rule: Rule, target: Any) -> Any:
        return rule.check_built(built_view(target, source_rows, facts))

    def apply(target: Any, finding: Finding) -> Any:
        owners[finding.rule_id].apply_built(target, finding)
        return target

    run_stage(trainer, enabled, settings.safety_mode, report, check=check, apply=apply)


def built_view(trainer: Any, source_rows: int | None = None, facts: dict[str, Any] | None = None) -> BuiltTrainer:
    """The read-only [`BuiltTrainer`] the built-stage rules inspect; `facts`: [`snapshot_facts`] if already taken."""
    peft_config = getattr(getattr(trainer.model, "peft_config", None), "get", lambda _: None)("default")
    return BuiltTrainer(
        kind=trainer.safety_kind,
        args=trainer.args,
        model=trainer.model,
        train_dataset=trainer.train_dataset,
        source_rows=source_rows,
        processing_class=getattr(trainer, "processing_class", None),
        ref_model=getattr(trainer, "ref_model", None),
        peft_config=peft_config,
        **(facts if facts is not None else snapshot_facts(trainer)),
)


def built_rule_ids(rules: Iterable[Rule] = DEFAULT_RULES) -> list[str]:
    """The rules with a check on the built trainer (they cannot run in `safe-trainers check`)."""
    return [rule.id for rule in rules if type(rule).check_built is not Rule.check_built]


def _check_setup(rule: Rule, setup: TrainerSetup) -> Any:
    return rule.check(setup)




def snapshot_facts(trainer: Any) -> dict[str, Any]:
    """What the `memory.*` rule reads: the run's strategy, the NaN guard's snapshot size per node, and the host memory
    available now (read from the built trainer and the machine: the action side of a pure check)."""
    import psutil

    from ..runtime.saved_weights import written_bytes
    from .snapshot_size import RunShape, per_node_bytes

    params = list(trainer.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    if trainer.is_deepspeed_enabled:
        strategy = f"zero{trainer.accelerator.state.deepspeed_plugin.zero_stage}"
    elif trainer.is_fsdp_enabled:
        strategy = "fsdp2"
    else:
        strategy = "ddp" if trainer.args.world_size > 1 else "single"
    if strategy == "zero0":
        return {}
    shape = RunShape(
        name=trainer.safety_kind,
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in trainable),
        strategy=strategy,
        world_size=trainer.args.world_size,
        gpus_per_node=local_ranks(trainer.args.world_size),
        weight_bytes=trainable[0].element_size() if trainable else 4,
        # One process or DDP keeps each trainable parameter in its own dtype, and AdamW's moments in that dtype too
        # (the snapshot holds exactly those bytes); FSDP2 and ZeRO keep the fp32 figures.
        trainable_bytes=trainable_bytes if strategy in ("single", "ddp") else None,
    )
    return {
        "snapshot_strategy": strategy,
        "snapshot_bytes_per_node": per_node_bytes(shape),
        "host_memory_available": least_across_ranks(psutil.virtual_memory().available),
        # A background save (one process, or rank 0 under DDP) copies what `save_pretrained` writes (a PEFT model's
        # adapters only) and AdamW's two moments per trainable parameter.
        "save_copy_bytes": (
            written_bytes(trainer.model) + 2 * trainable_bytes if strategy in ("single", "ddp") else None
        ),
    }


def least_across_ranks(value: int) -> int:
    """The smallest of every rank's `value` (a collective in a distributed run), so that every rank decides alike."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return min(values)


def local_ranks(world_size: int) -> int:
    """The ranks on this node: the elastic launcher's `LOCAL_WORLD_SIZE` (torchrun, `accelerate launch`), else one
    per visible GPU, at most `world_size`."""
    import os

    import torch

    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.isdigit():
        return int(local)
    return max(1, min(world_size, torch.cuda.device_count()))


__all__ = [
    "built_rule_ids",
    "built_view",
    "least_across_ranks",
    "local_ranks",
    "run_built_rules",
    "run_setup_rules",
    "snapshot_facts",
]
