"""Benchmark: how often the spike detector would skip a healthy step (false skips), and whether it skips injected
spikes, for every trainer, to choose the `nan_spike_*` defaults by measurement.

1. For each trainer (SFT, Reward, DPO, KTO, GRPO, RLOO) one long run on a tiny model with spike detection off records
   each step's agreed loss, gradient norm and skip flag (what the detector is fed). Each candidate setting (k, window,
   warm-up) is replayed through the detector itself ([`SpikeWindow`]) on that series: a flagged step is a false skip.
   The replay is exact for a setting with no false skip (the run would have been the same run); after a first false
   skip a real run would diverge, so counts above 0 are indicative.
2. For each trainer one real run with the chosen setting and injected spikes (a batch whose loss is x100, a gradient
   x1000 through the last decoder layer, `safe_trainers/testing/faults.py`): every injected step must be skipped.
   GRPO/RLOO train there on a reward that differs inside every group, so that each injected step has an update.
3. (`--phase cost`) the detector's own cost per step: `StepFlags.end_step` with and without it.

    python bench/spike_false_skips.py                     # 300 steps per trainer, the "guarded" preset (lr 1e-3)
    python bench/spike_false_skips.py --steps 150 --phase replay --learning-rate 1e-5
    python bench/spike_false_skips.py --phase inject --inject-steps 100 --learning-rate 1e-5 --spike 6 64 16
    python bench/spike_false_skips.py --phase cost
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time

import torch
from transformers import TrainerCallback
from workload import markdown_table, quiet

from safe_trainers.guard import read_events
from safe_trainers.guard.step.spikes import SpikeSettings, SpikeWindow
from safe_trainers.guard.step.flags import StepFlags
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.kinds import get_kind
from safe_trainers.testing.toy import rank_reward, save_toy_model

KINDS = ("sft", "reward", "dpo", "kto", "grpo", "rloo")
FACTORS = (4.0, 6.0, 8.0, 10.0)
WINDOWS = (32, 64, 128)
WARMUPS = (8, 16, 32)


class SeriesRecorder(TrainerCallback):
    """Keeps what the spike detector is fed at each step: the agreed loss, the gradient norm, the skip flag."""

    def __init__(self, guard):
        self.guard = guard
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # after the guard closed the step
        step = self.guard.flags.pending[-1]
        self.steps.append((step.loss.detach().clone(), step.grad_norm.clone(), step.fault | step.overflow))

    def series(self) -> list[tuple[float, float, bool]]:
        return [(float(loss), float(norm), bool(skip)) for loss, norm, skip in self.steps]


def replay(series: list[tuple[float, float, bool]], settings: SpikeSettings, spikes: dict | None = None) -> list:
    """The steps (1-based) the detector flags on `series`; `spikes`: step -> (loss factor, grad-norm factor)."""
    window = SpikeWindow(settings)
    flagged = []
    for step, (loss, norm, skipped) in enumerate(series, start=1):
        loss_factor, norm_factor = (spikes or {}).get(step, (1.0, 1.0))
        point = torch.tensor(loss * loss_factor), torch.tensor(norm * norm_factor)
        if bool(window.judge(*point, torch.tensor(not skipped))):
            flagged.append(step)
    return flagged


def model_for(kind: str, models: dict[str, str]) -> str:
    return models["rm" if kind == "reward" else "lm"]


def record(kind: str, models: dict[str, str], root: str, steps: int, **config) -> list[tuple[float, float, bool]]:
    trainer = build_trainer(
        kind, model_for(kind, models), os.path.join(root, f"{kind}-healthy"), preset="guarded", max_steps=steps,
        save_strategy="no", logging_steps=steps, nan_spike_factor=0.0, **config,
    )  # fmt: skip
    recorder = SeriesRecorder(trainer.nan_guard)
    trainer.add_callback(recorder)
    trainer.train()
    return recorder.series()


def injected_run(kind: str, models: dict, root: str, steps: int, at: dict[int, str], **config) -> tuple[list, list]:
    """A real run with the default spike settings and spikes injected at `at` (step -> kind): (injected, skipped)."""
    out = os.path.join(root, f"{kind}-spiked")
    faults = [Fault(step=s, kind=k, value=100.0 if k == "loss_scale" else 1000.0) for s, k in at.items()]
    # GRPO/RLOO: a reward that differs inside every group, so the injected steps have an update to skip (with the
    # preset's sparse reward most steps have a loss and gradient of exactly 0, where a x100 changes nothing).
    online = {"trainer_kwargs": {"reward_funcs": rank_reward}} if get_kind(kind).online else {}
    trainer = build_trainer(
        kind, model_for(kind, models), out, preset="guarded", max_steps=steps, save_strategy="no",
        logging_steps=steps, faults=faults, **online, **config,
    )  # fmt: skip
    trainer.train()
    injected = sorted({step for step, _ in trainer.fault_injector.injected})
    skipped = sorted(e["step"] for e in read_events(out) if e["kind"] in ("spike", "skip"))
    return injected, skipped


def lr_override(args) -> dict:
    return {} if args.learning_rate is None else {"learning_rate": args.learning_rate}


def spike_config(settings: SpikeSettings) -> dict:
    return dict(nan_spike_factor=settings.factor, nan_spike_window=settings.window, nan_spike_warmup=settings.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--inject-steps", type=int, default=120)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--phase", choices=("both", "replay", "inject", "cost"), default="both")
    parser.add_argument("--learning-rate", type=float, default=None, help="instead of the preset's 1e-3")
    parser.add_argument("--save-series", default=None, help="write the recorded series to this JSON file")
    parser.add_argument(
        "--spike", nargs=3, type=float, default=None, metavar=("K", "WINDOW", "WARMUP"),
        help="the setting of the injected runs (default: the configs' defaults)",
    )  # fmt: skip
    args = parser.parse_args()
    quiet()
    root = tempfile.mkdtemp(prefix="spike-bench-")
    models = {"lm": save_toy_model(os.path.join(root, "lm"), "qwen2")}
    models["rm"] = save_toy_model(os.path.join(root, "rm"), "qwen2", task="seq_cls")
    probe = build_trainer("dpo", models["lm"], os.path.join(root, "probe"))
    default = SpikeSettings.from_settings(probe.nan_guard.settings)
    if args.spike:
        default = SpikeSettings(args.spike[0], int(args.spike[1]), int(args.spike[2]))
    candidates = [SpikeSettings(k, w, u) for k, w, u in itertools.product(FACTORS, WINDOWS, WARMUPS) if u <= w]
    if default.enabled and default not in candidates:
        candidates.append(default)
    if args.phase == "cost":
        return measure_cost()
    if args.phase != "inject":
        measure_false_skips(args, models, root, default, candidates)
    if args.phase != "replay":
        measure_injected(args, models, root, default)


def measure_false_skips(args, models, root, default, candidates) -> None:
    series, seconds = {}, {}
    for kind in args.kinds:
        start = time.perf_counter()
        series[kind] = record(kind, models, root, args.steps, **lr_override(args))
        seconds[kind] = time.perf_counter() - start
    if args.save_series:
        with open(args.save_series, "w") as f:
            json.dump(series, f)
    # Replayed injections: a loss x100 (its gradient x100 too) and a gradient x1000, late in the run.
    late = {int(args.steps * 0.6): (100.0, 100.0), int(args.steps * 0.8): (1.0, 1000.0)}
    rows = []
    for settings in candidates:
        false = {kind: len(replay(series[kind], settings)) for kind in args.kinds}
        caught = sum(len(set(replay(series[kind], settings, late)) & set(late)) for kind in args.kinds)
        mark = " (default)" if settings == default else ""
        rows.append(
            (f"{settings.factor:g}", settings.window, settings.warmup, *false.values(), sum(false.values()),
             f"{caught}/{len(late) * len(args.kinds)}{mark}")
        )  # fmt: skip
    lr = args.learning_rate or 1e-3
    print(f"## False skips over {args.steps} healthy steps per trainer at lr {lr:g} (replayed), injections caught\n")
    print(markdown_table(["k", "window", "warm-up", *args.kinds, "total", "injected caught"], rows))
    print("\nRecording time per trainer (s): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))


def measure_cost(repeats: int = 3, calls: int = 2000) -> None:
    """The detector's own cost on the hot path: `StepFlags.end_step` with and without it (one thread, CPU tensors)."""
    torch.set_num_threads(1)

    def median_call(spikes: SpikeWindow | None) -> float:
        flags, norm, times = StepFlags(spikes=spikes), torch.tensor(1.0), []
        for i in range(calls):
            start = time.perf_counter()
            flags.observe_loss(torch.tensor(0.5 + 0.01 * (i % 5)))
            flags.end_step(i, norm, "cpu")
            times.append(time.perf_counter() - start)
            flags.pending.clear()
        return statistics.median(times[100:])

    rows = []
    for _ in range(repeats):
        off, on = median_call(None), median_call(SpikeWindow(SpikeSettings(6.0)))
        rows.append((f"{off * 1e6:.0f} us", f"{on * 1e6:.0f} us", f"{(on - off) * 1e6:.0f} us"))
    print(markdown_table(["end_step, detection off", "end_step, detection on", "added per step"], rows))


def measure_injected(args, models, root, default) -> None:
    if not default.enabled:
        print("\nThe default has spike detection off: no injected run (choose a setting with --spike).")
        return
    at = {args.inject_steps // 2: "loss_scale", args.inject_steps * 3 // 4: "grad_scale"}
    rows = []
    for kind in args.kinds:
        config = {**lr_override(args), **spike_config(default)}
        injected, skipped = injected_run(kind, models, root, args.inject_steps, at, **config)
        false = sorted(set(skipped) - set(injected))
        caught = sorted(set(injected) & set(skipped))
        rows.append((kind, injected, caught, false, "yes" if set(injected) <= set(skipped) else "NO"))
    lr = args.learning_rate or 1e-3
    print(f"\n## Real runs at lr {lr:g} with {default} and injected spikes ({args.inject_steps} steps)\n")
    print(markdown_table(["trainer", "injected at", "skipped", "other skips", "all skipped"], rows))


if __name__ == "__main__":
    main()
