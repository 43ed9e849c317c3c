"""Train one of the safe trainers on a toy model with injected faults; write a JSON result per rank.

Launched by the distributed guard tests, e.g.:
    accelerate launch --multi_gpu --num_processes 2 tests/workers/guard_worker.py --kind dpo --fault loss:6:1 \
        --model MODEL_DIR --out DIR
    deepspeed --num_gpus 2 tests/workers/guard_worker.py --kind dpo --fault loss:6:1 --model MODEL_DIR --out DIR \
        --deepspeed zero3.json
    torchrun --nproc_per_node 2 tests/workers/guard_worker.py --kind dpo --fault loss:6:1 --model MODEL_DIR --out DIR \
        --fsdp SHARDED_STATE_DICT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for guard_utils
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/workers/, for fsdp_on_cpu

import safe_trainers as st  # noqa: E402
from guard_utils import recording  # noqa: E402
from hook_utils import bypassing  # noqa: E402
from safe_trainers.errors import UpstreamHookError  # noqa: E402
from safe_trainers.restarts.background_save import CheckpointWriteError  # noqa: E402
from safe_trainers.runtime.sharding import replicated  # noqa: E402
from safe_trainers.testing.build import build_trainer  # noqa: E402
from safe_trainers.testing.faults import Fault  # noqa: E402
from safe_trainers.kinds import TRAINER_KINDS  # noqa: E402
from safe_trainers.trainers import trainer_class  # noqa: E402


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="dpo", choices=TRAINER_KINDS)
    parser.add_argument("--fault", action="append", default=[], help="kind:step[:rank[:value[:micro_batch]]]")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True, help="a saved toy model (safe_trainers.testing.toy.save_toy_model)")
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--fsdp", default=None, help="FSDP2 with this `state_dict_type` (CPU ranks: fsdp_on_cpu)")
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--max_rollbacks", type=int, default=3)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--rollback_from", default="memory", help="`nan_rollback_from`")
    parser.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from (`true`: the newest healthy one)")
    parser.add_argument("--gpu", action="store_true", help="train on the GPU in bf16 (the preset pins the CPU)")
    parser.add_argument("--save_final", action="store_true", help="`save_model(out/final)` after training")
    parser.add_argument("--bypass", action="append", default=[], help="a hook of the guard to take out (hook_utils)")
    parser.add_argument("--spike_factor", type=float, default=None, help="`nan_spike_factor` (default: the config's)")
    parser.add_argument("--learning_rate", type=float, default=None, help="(default: the preset's)")
    parser.add_argument("--snapshot_budget", type=float, default=None, help="`nan_snapshot_budget` (default: preset)")
    parser.add_argument("--snapshot_steps", type=int, default=0, help="`nan_snapshot_steps` (0: preset's; -1: unset)")
    parser.add_argument("--probe", action="store_true", help="record state digests and snapshot bytes (shard_probe)")
    parser.add_argument("--drop_shard", default=None, help="STEP:RANK: that rank drops its snapshot shard then")
    parser.add_argument(
        "--slow_rank", default=None, help="STEP:RANK:SECONDS: that rank sleeps after that step's optimizer step"
    )
    parser.add_argument("--hold_save", default=None, help="STEP:UNTIL: rank 0's writer holds STEP till UNTIL ends")
    parser.add_argument("--fail_save", type=int, default=None, help="rank 0's writer fails on checkpoint-STEP")
    parser.add_argument("--sync_saves", action="store_true", help="`save_in_background=False`")
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args(argv)


def fsdp2_config(state_dict_type: str) -> dict:
    """The settings of `configs/accelerate/fsdp2.yaml` (transformer-based wrap, reshard after forward)."""
    return {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
        "reshard_after_forward": True,
        "state_dict_type": state_dict_type,
    }


class SlowRank(TrainerCallback):
    """One rank sleeps after one step's optimizer step (a straggler: slower compute, a busy host), so the others
    reach that step's inspection first and wait for it there."""

    def __init__(self, step: str, rank: str, seconds: str):
        self.step, self.rank, self.seconds = int(step), int(rank), float(seconds)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if (state.global_step + 1, args.process_index) == (self.step, self.rank):
            time.sleep(self.seconds)


class SaveReaders(TrainerCallback):
    """Records each `on_save`: the checkpoint's step, the step training was at when it came, whether the checkpoint
    was published by then."""

    def __init__(self, trainer):
        self.trainer, self.seen = trainer, []

    def on_save(self, args, state, control, **kwargs):
        final = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        published = os.path.isfile(os.path.join(final, "trainer_state.json"))
        self.seen.append([state.global_step, self.trainer.state.global_step, published])


def background_writer(trainer, hold: str | None, fail: int | None):
    """Rank 0's writer held at a checkpoint until a later step ends on rank 0 (`--hold_save`), or failing on one
    (`--fail_save`)."""
    from safe_trainers.testing.held_writes import hold_writes

    if trainer.args.process_index != 0 or trainer.safe_run.saves is None:
        return None
    if hold:
        step, until = (int(v) for v in hold.split(":"))
        held = hold_writes(trainer, step)

        class Release(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == until:
                    held.release()

        trainer.add_callback(Release())
        return held
    held = hold_writes(trainer, fail)
    held.released.set()
    original = held.written

    def written(pending, write):
        original(pending, write)
        if pending.step == fail:
            raise OSError(28, "No space left on device (injected)")

    held.written = written
    return held


def write_result(out: str, result: dict) -> None:
    with open(os.path.join(out, f"result-rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


def main(argv: list[str] | None = None) -> int:
    """One run, or with `--jobs FILE` (a JSON list of argument lists) several, one after another in these processes
    and their process group: what a script that trains twice does, and one launch's start-up for several runs."""
    argv = sys.argv[1:] if argv is None else argv
    jobs = [argv]
    if "--jobs" in argv:
        at = argv.index("--jobs")
        with open(argv[at + 1]) as f:
            jobs = [job + argv[:at] + argv[at + 2 :] for job in json.load(f)]  # the launcher's own (`--local_rank`)
    for job in jobs:
        trainer = run(parse(job))
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # destroys the process group before the interpreter exits
    return 0


def run(ns: argparse.Namespace):
    """Trains as `ns` says and writes this rank's `result-rank<N>.json` under `ns.out`; returns the trainer."""
    if ns.deepspeed:
        # DeepSpeed's own communicator must be up before accelerate's state, or DeepSpeed sees a world of 1.
        import deepspeed

        deepspeed.init_distributed()
    fsdp = {}
    if ns.fsdp:
        import fsdp_on_cpu

        fsdp_on_cpu.enable()
        fsdp = dict(fsdp="full_shard auto_wrap", fsdp_config=fsdp2_config(ns.fsdp))
    state = PartialState()
    faults = []
    for spec in ns.fault:
        parts = spec.split(":")
        rank = int(parts[2]) if len(parts) > 2 and parts[2] != "*" else None
        value = float(parts[3]) if len(parts) > 3 else float("nan")
        micro_batch = int(parts[4]) if len(parts) > 4 else None
        faults.append(Fault(step=int(parts[1]), kind=parts[0], rank=rank, value=value, micro_batch=micro_batch))
    lora = {}
    if ns.lora:
        from peft import LoraConfig

        lora["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    # ns.model was written by the test before launching, so no rank races another to create it.
    trainer = build_trainer(
        ns.kind,
        ns.model,
        os.path.join(ns.out, "run"),
        preset="guarded",
        faults=faults,
        trainer_cls=bypassing(recording(trainer_class(ns.kind)), *ns.bypass),
        max_steps=ns.max_steps,
        save_steps=ns.save_steps,
        gradient_accumulation_steps=ns.ga,
        nan_max_rollbacks=ns.max_rollbacks,
        nan_rollback_from=ns.rollback_from,
        deepspeed=ns.deepspeed,
        trainer_kwargs=lora,
        **fsdp,
        **(dict(use_cpu=False, bf16=True, learning_rate=1e-5) if ns.gpu else {}),
        **({"nan_spike_factor": ns.spike_factor} if ns.spike_factor is not None else {}),
        **({"learning_rate": ns.learning_rate} if ns.learning_rate is not None else {}),
        **({"nan_snapshot_budget": ns.snapshot_budget} if ns.snapshot_budget is not None else {}),
        **({"nan_snapshot_steps": ns.snapshot_steps if ns.snapshot_steps > 0 else None} if ns.snapshot_steps else {}),
        **({"save_in_background": False} if ns.sync_saves else {}),
    )
    injector = trainer.fault_injector
    probe = None
    if ns.probe or ns.drop_shard:
        from shard_probe import ShardProbe

        drop = [int(v) for v in ns.drop_shard.split(":")] if ns.drop_shard else [None, None]
        probe = ShardProbe(trainer, *drop)
        trainer.add_callback(probe)
    if ns.slow_rank:
        trainer.add_callback(SlowRank(*ns.slow_rank.split(":")))
    readers = SaveReaders(trainer)
    trainer.add_callback(readers)
    held = background_writer(trainer, ns.hold_save, ns.fail_save) if ns.hold_save or ns.fail_save else None
    outcome = "finished"
    try:
        trainer.train(resume_from_checkpoint=True if ns.resume == "true" else ns.resume)
    except st.TrainingDivergedError as error:
        outcome = f"diverged: {error.checkpoint_dir}"
    except UpstreamHookError as error:  # raised on every rank alike
        outcome = f"stopped: {', '.join(error.hooks)}"
    except CheckpointWriteError as error:  # raised on every rank alike
        outcome = f"write failed: {error}"
    if ns.save_final:
        trainer.save_model(os.path.join(ns.out, "final"))  # FULL_STATE_DICT: gathered and written by rank 0
    params = [replicated(p) for p in trainer.model.parameters()]  # FSDP2: the whole parameter on every rank
    if trainer.is_deepspeed_enabled:
        optimizer = trainer.model_wrapped.optimizer
        flats = getattr(optimizer, "fp32_partitioned_groups_flat", None) or optimizer.single_partition_of_fp32_groups
        finite = all(bool(torch.isfinite(t).all()) for t in flats)
    else:
        finite = all(bool(torch.isfinite(p).all()) for p in params)
    result = {
        "rank": state.process_index,
        "world": state.num_processes,
        "outcome": outcome,
        "global_step": trainer.state.global_step,
        "finite": finite,
        "injected": injector.injected,
        "skipped": trainer.nan_guard.state.skipped_steps,
        "rollbacks": trainer.nan_guard.state.rollbacks,
        "spikes": trainer.nan_guard.state.spike_steps,
        "seen": getattr(trainer, "seen", []),
        "on_save": readers.seen,
        "held": held is not None and held.holding.is_set(),
        "background": trainer.safe_run.saves is not None,
        "fsdp_version": getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None), "fsdp_version", None),
        "state_dict_type": str(getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None), "state_dict_type", "")),
        "intervals": [e.detail for e in trainer.nan_guard.events.events if e.kind == "snapshot_interval"],
        "checksum": float(sum(p.detach().double().sum() for p in params if p.numel() > 0)),
    }
    if probe is not None:
        result.update(digests=probe.digests, host_bytes=probe.host_bytes, state_bytes=probe.state_bytes)
    write_result(ns.out, result)
    return trainer


if __name__ == "__main__":
    sys.exit(main())
