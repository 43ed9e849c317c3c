"""Train DPO on a toy model under torchrun's elastic agent, killing the process (SIGKILL) at chosen steps.

Launched by tests/restarts/test_crash_restarts.py and test_cluster_launches.py, e.g.:
    torchrun --standalone --nproc_per_node 1 --max-restarts 3 tests/workers/restart_worker.py --model MODEL_DIR \
        --out DIR --kill 6:0 --kill 7:1-
`--kill STEP:ATTEMPTS[:RANK]` kills the process when it feeds a micro-batch of optimizer step STEP to the model, in
the attempts listed (`0,2`, or `1-` for 1 and every later one; the attempt is torchrun's restart count), on one rank
or all. `--preempt` sends the process a SIGTERM there instead (a preemption: training goes on), `--hang` sleeps
there forever (a hang, for the watchdog; `--hang_timeout` sets its ceiling, `--hang_action` what a hang does), and
`--pause` writes `DIR/paused-rank<r>` there and waits until `DIR/go` exists (a run caught mid-training, for a second
run to meet). `--slow STEP:SECONDS[:RANK]` sleeps SECONDS there once, in attempt 0 (a step that hangs, then goes on);
`--hang_timeout_on RANK:SECONDS` gives one rank a ceiling of its own (only that rank's watchdog sees the step as
hung); `--report_to` names the reporting integrations (`"none"` by default).
Each rank appends to `DIR/stream-rank<r>.jsonl`, one line per micro-batch, before anything else happens to
it: `delivered` when the dataloader hands it to `training_step`, `fed` when it reaches the model. The attempt that
finishes writes `DIR/result-rank<r>.json`, with `expected`: the fingerprints of the micro-batches an uninterrupted
run trains, in order (one fresh pass over the prepared train dataloader).

As a cluster job can: `--stages N` runs N `train()` calls in one script (stage 1 in `DIR/run`, stage s in
`DIR/run<s>`, each starting from the previous stage's model; `--kill_stage` says which one `--kill` applies to; each
attempt appends what each stage's `train()` returned to `DIR/stages-rank<r>.jsonl`); `--die_before_train ATTEMPTS`
kills the process before `train()` (loading), `--job_ended ATTEMPTS` gives those attempts a `job_end_time` already
past (a deadline); `--backdate SECONDS` sets the file times of every published checkpoint
that far in the past (shared storage whose clock lags); `--truncate STEP:FILE` cuts `FILE` of `checkpoint-STEP` to half
its length once it is published, in attempt 0 (a save written in place and interrupted). `--push` uploads to the Hub
at every save (`push_to_hub=True`, `hub_strategy="every_save"`, the Hub at `HF_ENDPOINT`); `--pause` then waits for the
uploads of the saves before it (a background save's too).
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
from safe_trainers.trainer.background_checkpoints import announce  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", action="append", default=[], help="STEP:ATTEMPTS[:RANK]")
    parser.add_argument("--preempt", action="append", default=[], help="STEP:ATTEMPTS[:RANK] (SIGTERM to itself)")
    parser.add_argument("--hang", action="append", default=[], help="STEP:ATTEMPTS[:RANK] (sleeps forever)")
    parser.add_argument("--pause", action="append", default=[], help="STEP:ATTEMPTS[:RANK] (waits for DIR/go)")
    parser.add_argument("--slow", action="append", default=[], help="STEP:SECONDS[:RANK] (sleeps once, attempt 0)")
    parser.add_argument("--hang_timeout", type=float, default=900.0)
    parser.add_argument("--hang_timeout_on", default="", help="RANK:SECONDS (this rank's `hang_timeout`)")
    parser.add_argument("--report_to", action="append", default=[])
    parser.add_argument("--hang_action", default="auto")
    parser.add_argument("--save_on_each_node", action="store_true")
    parser.add_argument(
        "--fault", action="append", default=[], help="kind:step[:value] (a fault on every rank; NaN by default)"
    )
    parser.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True): a new job")
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--kill_stage", type=int, default=1)
    parser.add_argument("--die_before_train", default="", help="ATTEMPTS, as in --kill")
    parser.add_argument("--job_ended", default="", help="ATTEMPTS, as in --kill: `job_end_time` already past")
    parser.add_argument("--backdate", type=float, default=0.0)
    parser.add_argument("--truncate", default="", help="STEP:FILE")
    parser.add_argument("--save_total_limit", type=int, default=None)
    parser.add_argument("--rollback_from", default="memory")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--spike", default="", help="FACTOR:WARMUP (spike detection on)")
    parser.add_argument("--push", action="store_true", help="push_to_hub at every save (the Hub at HF_ENDPOINT)")
    parser.add_argument(
        "--slow_compile", default="", help="SECONDS:ATTEMPTS[:RANK] (the model is compiled; its first compile sleeps)"
    )
    return parser.parse_args(argv)


def fault_from(spec: str) -> Fault:
    """A `--fault` spec, `kind:step[:value]`."""
    kind, step, *value = spec.split(":")
    return Fault(step=int(step), kind=kind, value=float(value[0]) if value else float("nan"))


def in_attempts(attempts: str) -> bool:
    """Whether this attempt is one of `attempts` (`0,2`, or `1-` for 1 and every later one)."""
    if attempts.endswith("-"):
        return ATTEMPT >= int(attempts[:-1])
    return ATTEMPT in {int(a) for a in attempts.split(",")}


def kills_at(spec: str, rank: int) -> int | None:
    """The step `spec` kills this attempt on this rank at, or `None`."""
    parts = spec.split(":")
    if in_attempts(parts[1]) and (len(parts) < 3 or int(parts[2]) == rank):
        return int(parts[0])
    return None


class KillingDPOTrainer(trainer_class("dpo")):
    """Logs every micro-batch to the stream file, and kills the process where `--kill` says."""

    stream = None
    stage = 1
    kill_steps: set[int] = set()
    signal_steps: set[int] = set()
    hang_steps: set[int] = set()
    pause_steps: set[int] = set()
    slow_steps: dict[int, float] = {}

    def _log(self, event: str, inputs) -> None:
        step = self.state.global_step + 1
        line = {"attempt": ATTEMPT, "stage": self.stage, "step": step, "event": event, "hash": batch_hash(inputs)}
        self.stream.write(json.dumps(line) + "\n")
        self.stream.flush()

    def _earlier_checkpoints_published(self) -> None:
        """A `--kill` at step N dies after the checkpoints of earlier steps are published, as with synchronous saves,
        however slow the background writer is on a loaded machine (a kill during a background write is tested in
        tests/guard/test_background_saves.py). Waits for this rank's writer only: no collective."""
        saves = self.safe_run.saves
        while saves is not None and not saves.done():
            time.sleep(0.01)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._log("delivered", inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and not self.safe_run.hooks.replaying:  # not the guard's diagnostic replay of a NaN step
            self._log("fed", inputs)
            step = self.state.global_step + 1
            if step in self.kill_steps:
                self._earlier_checkpoints_published()
                os.kill(os.getpid(), signal.SIGKILL)
            if step in self.signal_steps:
                self.signal_steps.discard(step)  # once (the micro-batches of the step go on)
                os.kill(os.getpid(), signal.SIGTERM)
            if step in self.pause_steps:
                self.pause_steps.discard(step)
                announce(self)  # a background save of an earlier step is published (and uploaded) first: a stable state
                if self.args.push_to_hub:
                    self._finish_current_push()  # the uploads begun at the saves before the pause are done
                out = os.path.dirname(self.stream.name)
                open(os.path.join(out, f"paused-rank{self.args.process_index}"), "w").close()
                while not os.path.exists(os.path.join(out, "go")):
                    time.sleep(0.05)
            if step in self.slow_steps:
                time.sleep(self.slow_steps.pop(step))  # once (the micro-batches of the step go on)
            if step in self.hang_steps:
                while True:
                    time.sleep(3600)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class DamagesCheckpoints(TrainerCallback):
    """After each save: backdate the checkpoint's files (`--backdate`). Once `checkpoint-STEP` is published, truncate
    one of its files (`--truncate`), at the first step boundary after it: a background save publishes when its writer
    is done, which `on_save` (made at the first boundary after that) may not reach before a `--kill` of a later step."""

    def __init__(self, backdate: float, truncate: str):
        self.backdate = backdate
        self.truncate = truncate.split(":") if truncate and ATTEMPT == 0 else None

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not self.backdate:
            return
        past = time.time() - self.backdate
        for root, _, names in os.walk(os.path.join(args.output_dir, f"checkpoint-{state.global_step}")):
            for name in [*names, "."]:
                os.utime(os.path.join(root, name), (past, past))

    def on_step_begin(self, args, state, control, **kwargs):
        if self.truncate is None or not state.is_world_process_zero or state.global_step < int(self.truncate[0]):
            return
        file = os.path.join(args.output_dir, f"checkpoint-{self.truncate[0]}", self.truncate[1])
        deadline = time.monotonic() + 120
        while not os.path.isfile(file) and time.monotonic() < deadline:  # published by the writer thread
            time.sleep(0.05)
        os.truncate(file, os.path.getsize(file) // 2)
        self.truncate = None


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


def compiled_model(path: str, spec: str, rank: int):
    """The model at `path`, compiled (`torch.compile`) with a backend whose first compile sleeps where `spec` says
    (`SECONDS:ATTEMPTS[:RANK]`, as `--kill`): a long inductor build on one rank."""
    from transformers import AutoModelForCausalLM

    sleep = kills_at(spec, rank)
    compiles = []

    def backend(graph_module, example_inputs):
        if sleep and not compiles:
            time.sleep(sleep)
        compiles.append(len(example_inputs))
        return graph_module.forward

    model = AutoModelForCausalLM.from_pretrained(path)
    model.compile(backend=backend)
    return model


def checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def main(argv=None) -> int:
    ns = parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(ns.out, exist_ok=True)
    KillingDPOTrainer.stream = open(os.path.join(ns.out, f"stream-rank{rank}.jsonl"), "a")
    kill_steps = {s for s in (kills_at(spec, rank) for spec in ns.kill) if s is not None}
    KillingDPOTrainer.signal_steps = {s for s in (kills_at(spec, rank) for spec in ns.preempt) if s is not None}
    KillingDPOTrainer.hang_steps = {s for s in (kills_at(spec, rank) for spec in ns.hang) if s is not None}
    KillingDPOTrainer.pause_steps = {s for s in (kills_at(spec, rank) for spec in ns.pause) if s is not None}
    for spec in ns.slow:
        step, seconds, *on = spec.split(":")
        if ATTEMPT == 0 and (not on or int(on[0]) == rank):
            KillingDPOTrainer.slow_steps[int(step)] = float(seconds)
    hang_timeout = ns.hang_timeout
    if ns.hang_timeout_on and int(ns.hang_timeout_on.split(":")[0]) == rank:
        hang_timeout = float(ns.hang_timeout_on.split(":")[1])
    faults = [fault_from(spec) for spec in ns.fault]
    spikes = {}
    if ns.spike:
        factor, warmup = ns.spike.split(":")
        spikes = {"nan_spike_factor": float(factor), "nan_spike_warmup": int(warmup)}
    model = compiled_model(ns.model, ns.slow_compile, rank) if ns.slow_compile else ns.model
    for stage in range(1, ns.stages + 1):
        KillingDPOTrainer.stage = stage
        KillingDPOTrainer.kill_steps = kill_steps if stage == ns.kill_stage else set()
        trainer = build_trainer(
            "dpo",
            model,
            os.path.join(ns.out, "run" if stage == 1 else f"run{stage}"),
            preset="guarded",
            faults=faults if stage == ns.kill_stage else [],
            trainer_cls=KillingDPOTrainer,
            max_steps=ns.max_steps,
            save_steps=ns.save_steps,
            save_total_limit=ns.save_total_limit,
            nan_rollback_from=ns.rollback_from,
            learning_rate=ns.learning_rate,
            hang_timeout=hang_timeout,
            hang_action=ns.hang_action,
            save_on_each_node=ns.save_on_each_node,
            report_to=ns.report_to or "none",
            job_end_time=time.time() - 1 if ns.job_ended and in_attempts(ns.job_ended) else None,
            **spikes,
            **(dict(push_to_hub=True, hub_strategy="every_save", hub_model_id="local/test") if ns.push else {}),
        )
        trainer.add_callback(DamagesCheckpoints(ns.backdate, ns.truncate))
        if ns.die_before_train and in_attempts(ns.die_before_train):
            os.kill(os.getpid(), signal.SIGKILL)
        # A restart: the elastic agent's restart count tells the trainer; `--resume` is a new job.
        output = trainer.train(resume_from_checkpoint=True if ns.resume else None)
        returned = {"attempt": ATTEMPT, "stage": stage, "global_step": output.global_step,
                    "training_loss": output.training_loss, "metrics": output.metrics,
                    "checksum": checksum(trainer.model)}  # fmt: skip
        with open(os.path.join(ns.out, f"stages-rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(returned) + "\n")
        model = trainer.model
    guard = trainer.nan_guard
    result = {
        "attempt": ATTEMPT,
        "global_step": trainer.state.global_step,
        "finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()),
        "skipped": guard.state.skipped_steps,
        "rollbacks": guard.state.rollbacks,
        "lr_scale": guard.state.lr_scale,
        "spikes": guard.state.spike_steps,
        "checksum": checksum(trainer.model),
        "expected": expected_stream(trainer, ns.max_steps * trainer.args.gradient_accumulation_steps),
    }
    with open(os.path.join(ns.out, f"result-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
