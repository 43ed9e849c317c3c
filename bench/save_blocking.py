"""How long a checkpoint blocks the training loop: stock TRL, safe_trainers with background saves (the default), and
safe_trainers with `save_in_background=False`, on a full SFT fine-tune of a Qwen2-style model built from a config
(`workload.py`'s `build_model_dir`), a checkpoint every `--save-steps` steps, one process.

Per checkpoint, the time the save blocked the loop: the time inside the trainer's `_save_checkpoint` (for the
background saves: the wait for the previous save in flight, the host copy and the small files), plus, at the last
step, the wait for the last save to be published before `train()` goes on. Then the whole `train()` call of each, and
its ratio to stock's. Wall time by default: a background write runs on another thread, whose CPU time the process's
CPU clock would count as the loop's (`--clock cpu` for the whole-run figure on a loaded machine).

    python bench/save_blocking.py --hidden 1024 --layers 12 --steps 20 --save-steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import trl  # noqa: E402
from workload import build_model_dir, device_name, markdown_table, parameter_count, quiet, release  # noqa: E402

from safe_trainers.testing.build import build_trainer  # noqa: E402
from safe_trainers.trainers import trainer_class  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
RUNS = {  # name -> (trainer class, config class or None: the safe one, safe settings)
    "stock TRL": (trl.SFTTrainer, trl.SFTConfig, {}),
    "safe, background": (trainer_class("sft"), None, {"save_in_background": True}),
    "safe, synchronous": (trainer_class("sft"), None, {"save_in_background": False}),
}


def timed(cls: type) -> type:
    """`cls` recording the wall time of each `_save_checkpoint`, and of the last step's log-save-evaluate beyond it
    (where a background save's last write is waited for)."""

    class Timed(cls):
        def _save_checkpoint(self, model, trial):
            began = time.perf_counter()
            super()._save_checkpoint(model, trial)
            self.blocked.append(time.perf_counter() - began)

        def _maybe_log_save_evaluate(self, *args, **kwargs):
            began, saves = time.perf_counter(), sum(self.blocked)
            super()._maybe_log_save_evaluate(*args, **kwargs)
            if self.state.global_step >= self.state.max_steps:
                self.final_wait = max(time.perf_counter() - began - (sum(self.blocked) - saves), 0.0)

    Timed.__name__ = cls.__name__
    return Timed


def run(ns, name: str, model_dir: str, root: str) -> tuple[list[float], float]:
    cls, config_cls, settings = RUNS[name]
    own = dict(config_cls=config_cls) if config_cls is not None else {}
    trainer = build_trainer(
        "sft", model_dir, os.path.join(root, name.replace(" ", "_").replace(",", "")), trainer_cls=timed(cls),
        rows=ns.steps * ns.batch, max_steps=ns.steps, per_device_train_batch_size=ns.batch, save_strategy="steps",
        save_steps=ns.save_steps, logging_steps=ns.save_steps, learning_rate=1e-5, optim=ns.optim,
        max_length=ns.seq, report_to=[], use_cpu=not torch.cuda.is_available(), **own, **settings,
    )  # fmt: skip
    trainer.blocked, trainer.final_wait = [], 0.0
    clock = CLOCKS[ns.clock]
    began = clock()
    trainer.train()
    whole = clock() - began
    blocked = list(trainer.blocked)
    blocked[-1] += trainer.final_wait
    del trainer
    release()
    return blocked, whole


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=64, help="`max_length` of the SFT rows")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--optim", default="adamw_torch")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="the whole-run clock")
    parser.add_argument("--dir", default=None, help="where the runs write (default: a temporary directory)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    ns = parse(argv)
    quiet()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    with tempfile.TemporaryDirectory(dir=ns.dir) as root:
        model_dir = build_model_dir(root, ns.hidden, ns.layers)
        results = {name: run(ns, name, model_dir, root) for name in RUNS}
    stock_blocked, stock_whole = results["stock TRL"]
    saves = len(stock_blocked)
    header = ["measure"] + list(RUNS)
    rows = [(f"checkpoint {i + 1} blocked (s)", *(f"{results[n][0][i]:.2f}" for n in RUNS)) for i in range(saves)]
    rows.append(("median blocked (s)", *(f"{statistics.median(results[n][0]):.2f}" for n in RUNS)))
    rows.append(
        ("median blocked / stock's", *(f"{statistics.median(results[n][0]) / statistics.median(stock_blocked):.3f}"
                                        for n in RUNS))
    )  # fmt: skip
    rows.append((f"whole train() ({ns.clock}, s)", *(f"{results[n][1]:.1f}" for n in RUNS)))
    rows.append(("whole run / stock's", *(f"{results[n][1] / stock_whole:.3f}" for n in RUNS)))
    params = parameter_count(ns.hidden, ns.layers) / 1e6
    print(
        f"Save blocking: {params:.1f}M parameters (hidden {ns.hidden} x {ns.layers} layers, fp32, AdamW), "
        f"{ns.steps} steps, a checkpoint every {ns.save_steps}; {device_name()}, {torch.get_num_threads()} threads.\n"
    )
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
