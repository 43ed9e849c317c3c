"""One builder for short runs on tiny models: the tests, the demo and the bench build their trainers with it.

A run starts from [`~safe_trainers.testing.quick.quick_args`] (2 steps of batch 2, no saves) and one of two named
presets on top ([`PRESETS`]), where the two uses really differ:

- `"quick"` (the rule and trainer tests, the bench): lr 1e-5, so `optim.learning_rate` stays quiet; 8 toy rows;
  GRPO/RLOO make 2 completions of up to 8 tokens, scored by `rank_reward`.
- `"guarded"` (the NaN guard tests, the demo): 10 steps at lr 1e-3, a checkpoint every 4 steps and a guard snapshot
  every 2 (a fixed interval: `nan_snapshot_budget=0`), on the CPU, 8 toy rows per step; GRPO/RLOO make 2 completions
  of up to 6 tokens, scored by `count_words_reward`; a `FaultInjector` is attached.

```python
>>> from safe_trainers.testing.build import build_trainer
>>> from safe_trainers.testing.faults import Fault
>>> trainer = build_trainer("dpo", "path/to/tiny-model", "out", preset="guarded", faults=[Fault(step=3, kind="loss")])
```
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..kinds import get_kind
from .faults import Fault, FaultInjector, with_loss_faults
from .quick import quick_args
from .toy import count_words_reward, dataset_for, rank_reward


@dataclass(frozen=True)
class Preset:
    """A named set of run settings for [`build_trainer`], applied on top of `quick_args`.

    Args:
        config (`dict`): config fields for every kind. A field the config class lacks (e.g. `nan_snapshot_steps` on a
            stock TRL config) is left out, so one preset serves the safe and the stock trainer of a comparison.
        online (`dict`): config fields added for the online kinds (GRPO, RLOO): how many completions, how long.
        reward (`Callable`): the reward function of the online kinds when the caller names none.
        rows (`int | None`): toy rows to train on; `None`: 8 for each optimizer step (`max_steps`), so no row comes
            back within a run of up to 4 micro-batches of 2 per step.
        inject_faults (`bool`): attach a [`~safe_trainers.testing.faults.FaultInjector`] (also when it has no
            fault), kept as `trainer.fault_injector`.
    """

    config: dict[str, Any]
    online: dict[str, Any]
    reward: Callable[..., list[float]]
    rows: int | None = None
    inject_faults: bool = False


PRESETS: dict[str, Preset] = {
    # `learning_rate=1e-5`: the highest full fine-tuning rate `optim.learning_rate` accepts without a warning, so a
    # test sees only the findings of the setting it is about.
    "quick": Preset(
        config=dict(learning_rate=1e-5),
        online=dict(num_generations=2, max_completion_length=8),
        reward=rank_reward,
        rows=8,
    ),
    # Long enough for a fault, a skip or a rollback, a save before and after it, and a snapshot to roll back to.
    # Pinned to the CPU: the guard tests compare replayed batches and restored weights exactly.
    "guarded": Preset(
        config=dict(
            max_steps=10,
            learning_rate=1e-3,
            save_strategy="steps",
            save_steps=4,
            nan_snapshot_steps=2,
            nan_snapshot_budget=0.0,  # snapshots at fixed steps: the guard tests roll back to known ones
            use_cpu=True,
        ),
        online=dict(num_generations=2, max_completion_length=6),
        reward=count_words_reward,
        inject_faults=True,
    ),
}


def preset_args(kind: str, output_dir: str | os.PathLike, preset: str = "quick", **overrides: Any) -> dict[str, Any]:
    """The config keyword arguments of a run of trainer kind `kind` under `preset`; `overrides` win.

    Every preset field is kept here; [`build_trainer`] leaves out those its config class lacks.
    """
    chosen = _preset(preset)
    args = quick_args(output_dir=str(output_dir), **chosen.config)
    if get_kind(kind).online:
        args.update(chosen.online)
    args.update(overrides)
    return args


def build_trainer(
    kind: str,
    model: Any,
    output_dir: str | os.PathLike,
    *,
    preset: str = "quick",
    faults: Sequence[Fault] = (),
    dataset: Any = None,
    rows: int | None = None,
    eval_rows: int = 0,
    trainer_cls: type | None = None,
    config_cls: type | None = None,
    trainer_kwargs: Mapping[str, Any] | None = None,
    **config: Any,
):
    """A trainer of `kind` on `model` (a path or a model) for a short run, set up by `preset` (see [`PRESETS`]).

    Args:
        kind (`str`): a key of [`~safe_trainers.kinds.KINDS`], e.g. `"dpo"`.
        model (`str` or `PreTrainedModel`): what the trainer gets as `model`.
        output_dir (`str` or `os.PathLike`): the run's `output_dir`.
        preset (`str`): `"quick"` or `"guarded"`.
        faults (`Sequence[Fault]`): faults to inject; a `FaultInjector` is attached when there are any, or when the
            preset always attaches one. A `loss_scale` fault mixes `LossScaleFaults` into the trainer class.
        dataset (`Dataset`, *optional*): the training data; by default the toy data of `kind`.
        rows (`int`, *optional*): how many toy rows, instead of the preset's.
        eval_rows (`int`): with more than 0, an evaluation set of that many toy rows (another seed).
        trainer_cls (`type`, *optional*): the trainer class; by default the safe trainer of `kind`. A stock TRL class
            works too, with its config class as `config_cls`.
        config_cls (`type`, *optional*): the config class; by default the safe config of `kind`.
        trainer_kwargs (`Mapping`, *optional*): more trainer keywords (`peft_config`, `ref_model`, `reward_funcs`...).
        **config: config fields; they win over the preset's and are always passed, so a misspelt one still fails.
    """
    from ..configs import config_class
    from ..trainers import trainer_class

    chosen = _preset(preset)
    config_cls = config_cls or config_class(kind)
    known = {f.name for f in fields(config_cls)}
    settings = {k: v for k, v in preset_args(kind, output_dir, preset).items() if k in known}
    args = config_cls(**{**settings, **config})
    extra = dict(trainer_kwargs or {})
    if get_kind(kind).online:
        extra.setdefault("reward_funcs", chosen.reward)
    if eval_rows:
        extra["eval_dataset"] = dataset_for(kind, eval_rows, seed=1)
    if dataset is None:
        dataset = dataset_for(kind, rows or chosen.rows or 8 * args.max_steps)
    cls = trainer_cls or trainer_class(kind)
    if any(fault.kind == "loss_scale" for fault in faults):
        cls = with_loss_faults(cls)  # the loss is scaled where the trainer computes it
    trainer = cls(model=model, args=args, train_dataset=dataset, **extra)
    if faults or chosen.inject_faults:
        trainer.fault_injector = FaultInjector(list(faults))
        trainer.add_callback(trainer.fault_injector)
    return trainer


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"Unknown `preset={name!r}`; choose one of {sorted(PRESETS)}.")
    return PRESETS[name]


__all__ = ["PRESETS", "Preset", "build_trainer", "preset_args"]
