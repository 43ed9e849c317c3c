"""Train DPO on a toy model under torchrun's elastic agent, killing the process (SIGKILL) at chosen steps.

Launched by tests/guard/test_guard_restart.py, e.g.:
    torchrun --standalone --nproc_per_node 1 --max-restarts 3 tests/workers/restart_worker.py --model MODEL_DIR \
        --out DIR --kill 6:0 --kill 7:1-
`--kill STEP:ATTEMPTS[:RANK]` kills the process when it feeds a micro-batch of optimizer step STEP to the model, in
the attempts listed (`0,2`, or `1-` for 1 and every later one; the attempt is torchrun's restart count), on one rank
or all. `--preempt` sends the process a SIGTERM there instead (a preemption: training goes on), and `--hang` sleeps
there forever (a hang, for the watchdog; `--hang_timeout` sets its ceiling).
Each rank appends to `DIR/stream-rank<r>.jsonl`, one line per micro-batch, before anything else happens to
it: `delivered` when the dataloader hands it to `training_step`, `fed` when it reaches the model. The attempt that
finishes writes `DIR/result-rank<r>.json`, with `expected`: the fingerprints of the micro-batches an uninterrupted
run trains, in order (one fresh pass over the prepared train dataloader).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for guard_utils

from guard_utils import batch_hash  # noqa: E402
from safe_trainers.testing.build import build_trainer  # noqa: E402
from safe_trainers.trainers import trainer_class  # noqa: E402
from safe_trainers.testing.faults import Fault  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", action="append", default=[], help="STEP:ATTEMPTS[:RANK]")
    parser.add_argument("--preempt", action="append", default=[], help="STEP:ATTEMPTS[:RANK] (SIGTERM to itself)")
    parser.add_argument("--hang", action="append", default=[], help="STEP:ATTEMPTS[:RANK] (sleeps forever)")
    parser.add_argument("--hang_timeout", type=float, default=900.0)
    parser.add_argument("--fault", action="append", default=[], help="kind:step (a NaN fault on every rank)")
    parser.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True): a new job")
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--save_steps", type=int, default=4)
    return parser.parse_args(argv)


def kills_at(spec: str, rank: int) -> int | None:
    """The step `spec` kills this attempt on this rank at, or `None`."""
    parts = spec.split(":")
    attempts = parts[1]
    if attempts.endswith("-"):
        hit = ATTEMPT >= int(attempts[:-1])
    else:
        hit = ATTEMPT in {int(a) for a in attempts.split(",")}
    if hit and (len(parts) < 3 or int(parts[2]) == rank):
        return int(parts[0])
    return None


class KillingDPOTrainer(trainer_class("dpo")):
    """Logs every micro-batch to the stream file, and kills the process where `--kill` says."""

    stream = None
    kill_steps: set[int] = set()
    signal_steps: set[int] = set()
    hang_steps: set[int] = set()

    def _log(self, event: str, inputs) -> None:
        line = {"attempt": ATTEMPT, "step": self.state.global_step + 1, "event": event, "hash": batch_hash(inputs)}
        self.stream.write(json.dumps(line) + "\n")
        self.stream.flush()

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._log("delivered", inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and not self.nan_guard.replaying:  # not the guard's diagnostic replay of a NaN step
            self._log("fed", inputs)
            step = self.state.global_step + 1
            if step in self.kill_steps:
                os.kill(os.getpid(), signal.SIGKILL)
            if step in self.signal_steps:
                self.signal_steps.discard(step)  # once (the micro-batches of the step go on)
                os.kill(os.getpid(), signal.SIGTERM)
            if step in self.hang_steps:
                while True:
                    time.sleep(3600)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def expected_stream(trainer, micro_batches: int) -> list[str]:
    loader = trainer.accelerator.prepare(trainer.get_train_dataloader())
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(0)
    hashes = []
    for batch in loader:
        hashes.append(batch_hash(batch))
        if len(hashes) == micro_batches:
            break
    return hashes


def main(argv=None) -> int:
    ns = parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(ns.out, exist_ok=True)
    KillingDPOTrainer.stream = open(os.path.join(ns.out, f"stream-rank{rank}.jsonl"), "a")
    KillingDPOTrainer.kill_steps = {s for s in (kills_at(spec, rank) for spec in ns.kill) if s is not None}
    KillingDPOTrainer.signal_steps = {s for s in (kills_at(spec, rank) for spec in ns.preempt) if s is not None}
    KillingDPOTrainer.hang_steps = {s for s in (kills_at(spec, rank) for spec in ns.hang) if s is not None}
    faults = [Fault(step=int(spec.split(":")[1]), kind=spec.split(":")[0]) for spec in ns.fault]
    trainer = build_trainer(
        "dpo",
        ns.model,
        os.path.join(ns.out, "run"),
        preset="guarded",
        faults=faults,
        trainer_cls=KillingDPOTrainer,
        max_steps=ns.max_steps,
        save_steps=ns.save_steps,
        hang_timeout=ns.hang_timeout,
    )
    trainer.train(resume_from_checkpoint=True if ns.resume else None)  # a restart: the agent's count tells it
    guard = trainer.nan_guard
    result = {
        "attempt": ATTEMPT,
        "global_step": trainer.state.global_step,
        "finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()),
        "skipped": guard.state.skipped_steps,
        "rollbacks": guard.state.rollbacks,
        "lr_scale": guard.state.lr_scale,
        "checksum": float(sum(p.detach().double().sum() for p in trainer.model.parameters())),
        "expected": expected_stream(trainer, ns.max_steps * trainer.args.gradient_accumulation_steps),
    }
    with open(os.path.join(ns.out, f"result-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
