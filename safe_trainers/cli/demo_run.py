"""The `safe-trainers demo`: an unsafe DPO config on a tiny Gemma-2, two injected faults, and stock TRL for contrast.

Everything is built locally (no network) and runs on a CPU in well under a minute.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import warnings
from typing import Any

import torch
from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from ..guard import read_events
from ..runtime.checkpoint_dirs import checkpoints
from ..guard import discarded_updates
from ..testing.faults import Fault


class StepPrinter(TrainerCallback):
    """One short line per logged step (loss, grad norm, guard counters) instead of transformers' dict dump."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            skipped = logs.get("nan_guard/skipped_steps", "-")
            rollbacks = logs.get("nan_guard/rollbacks", "-")
            print(
                f"{self.prefix} step {state.global_step:>2}  loss {_fmt(logs['loss'])}  "
                f"grad_norm {_fmt(logs.get('grad_norm'))}  skipped {skipped}  rollbacks {rollbacks}"
            )


def run_demo(output_dir: str | None = None, steps: int = 12, compare: bool = True) -> int:
    """Run the demo; return 0 when the guarded run ends with finite weights and clean checkpoints."""
    from transformers.utils import logging as hf_logging

    from ..testing.build import build_trainer
    from ..testing.toy import dataset_for, save_toy_model

    import datasets

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    logging.basicConfig(format="%(message)s")
    output_dir = output_dir or tempfile.mkdtemp(prefix="safe-trainers-demo-")
    model_dir = save_toy_model(os.path.join(output_dir, "tiny-gemma2"), "gemma2")
    data = dataset_for("dpo", 64)
    faults = [Fault(step=6, kind="loss"), Fault(step=9, kind="weight")]

    _banner("1. An unsafe DPO config, as often seen in the wild (fp16, sdpa on Gemma-2, no clipping)")
    print(
        "DPOConfig(fp16=True, max_grad_norm=0.0, model_init_kwargs={'dtype': 'float16', "
        "'attn_implementation': 'sdpa'})  # + `from safe_trainers import DPOTrainer`"
    )
    trainer = unsafe_trainer(model_dir, os.path.join(output_dir, "safe"), steps, data, faults)
    args = trainer.args
    print(f"-> training with bf16={trainer.args.bf16}, attention={trainer.model.config._attn_implementation!r}, "
          f"max_grad_norm={trainer.args.max_grad_norm}; report in {args.output_dir}/safety_report.json")

    _banner(f"2. Training with injected faults: NaN loss at step 6, NaN weight at step 9 ({steps} steps)")
    _quiet(trainer, "[safe_trainers]")
    _train(trainer)
    finite = all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    print("\nNaN guard events (nan_events.jsonl):")
    events = read_events(args.output_dir)
    for event in events:
        print(describe_event(event, {e["step"] for e in events if e["kind"] == "skip"}))
    saved = [os.path.basename(c) for c in checkpoints(args.output_dir)]
    print(f"final weights finite: {finite}; checkpoints: {saved} (each checked finite before it was written)")

    if compare:
        import trl

        _banner("3. Stock TRL, same (already fixed) settings, same NaN loss at step 6")
        stock = build_trainer(
            "dpo",
            model_dir,
            os.path.join(output_dir, "stock"),
            faults=faults[:1],
            trainer_cls=trl.DPOTrainer,
            config_cls=trl.DPOConfig,
            model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "eager"},
            **_common(steps, data),
        )
        stock_args = stock.args
        _quiet(stock, "[stock TRL]    ")
        _train(stock)
        stock_finite = all(bool(torch.isfinite(p).all()) for p in stock.model.parameters())
        print(f"stock TRL final weights finite: {stock_finite}; its checkpoints: "
              f"{[os.path.basename(c) for c in checkpoints(stock_args.output_dir)]} "
              "(the NaN loss is logged as 0.0 by `logging_nan_inf_filter`, and every later checkpoint holds NaN)")
    _banner("done")
    print(f"outputs in {output_dir}")
    return 0 if finite else 1


def unsafe_trainer(model_dir: str, output_dir: str, steps: int, data: Any, faults: list[Fault] = ()) -> Any:
    """The demo's `safe_trainers.DPOTrainer` from an unsafe config (fp16 and sdpa on Gemma-2, no clipping, lr 1e-3);
    its construction prints the safety report the README shows."""
    from ..testing.build import build_trainer

    return build_trainer(
        "dpo",
        model_dir,
        output_dir,
        faults=list(faults),
        fp16=True,
        max_grad_norm=0.0,
        model_init_kwargs={"dtype": "float16", "attn_implementation": "sdpa"},
        nan_snapshot_steps=4,
        **_common(steps, data),
    )


def describe_event(event: dict[str, Any], skipped: set[int]) -> str:
    """One line for an event of `nan_events.jsonl` (`skipped`: the steps with a `skip` event)."""
    if event["kind"] == "snapshot_interval":
        return f"  step {event['step']:>2} snapshots every {event['interval']} steps (measured, within the budget)"
    line = f"  step {event['step']:>2} {event['kind']:<8} non-finite: {', '.join(event['nonfinite'])}"
    if event["kind"] == "skip":
        line += " -> update not applied"
    where = (event.get("first_nonfinite_module") or {}).get("module")
    if where:
        line += f"; first non-finite module: {where}"
    if event["kind"] == "rollback":
        line += (f" -> restored the weights of step {event['restored_step']}; "
                 f"{discarded_updates(event['discarded_steps'], skipped)}; "
                 f"learning rate now {event['learning_rate']:.3g}")  # fmt: skip
    return line


def _train(trainer: Any) -> None:
    # TRL's DPO loss reads `model.is_gradient_checkpointing`, a property recent transformers releases deprecate, so
    # each step can print a FutureWarning that the demo's settings do not cause and cannot avoid: muted for the demo's
    # own two runs only, and only that message.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        trainer.train()


def _common(steps: int, data: Any) -> dict[str, Any]:
    # The NaN guard tests' preset (a checkpoint every 4 steps, faults injected), on a GPU when there is one: the tests
    # pin the CPU, the demo shows the machine it runs on.
    return dict(preset="guarded", dataset=data, max_steps=steps, use_cpu=not torch.cuda.is_available())


def _quiet(trainer: Any, prefix: str) -> None:
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(StepPrinter(prefix))


def _banner(text: str) -> None:
    print(f"\n=== {text}")


def _fmt(value: Any) -> str:
    if value is None:
        return "   -  "
    return f"{value:6.4f}" if math.isfinite(value) else f"{value!s:>6}"
