"""Train one safe trainer under FSDP2 on the GPU, with a NaN loss injected at one step, save the final model, and
write a JSON result.

Launched by tests/gpu/test_gpu_fsdp2.py as a one-process `accelerate launch --use_fsdp --fsdp_version 2 ...`:
    accelerate launch --use_fsdp --fsdp_version 2 --fsdp_state_dict_type FULL_STATE_DICT --num_processes 1 \
        tests/workers/fsdp2_worker.py --kind sft --model MODEL_DIR --out DIR --fault loss:3
"""

from __future__ import annotations

import argparse
import json
import os
import sys


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for guard_utils

from guard_utils import guarded_trainer  # noqa: E402
from safe_trainers.kinds import TRAINER_KINDS  # noqa: E402
from safe_trainers.testing.faults import Fault  # noqa: E402


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="sft", choices=TRAINER_KINDS)
    parser.add_argument("--model", required=True, help="a saved toy model (safe_trainers.testing.toy.save_toy_model)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--fault", action="append", default=[], help="kind:step, e.g. loss:3")
    parser.add_argument("--max_steps", type=int, default=8)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    ns = parse(argv)
    faults = [Fault(step=int(spec.split(":")[1]), kind=spec.split(":")[0]) for spec in ns.fault]
    trainer = guarded_trainer(
        ns.kind,
        ns.model,
        os.path.join(ns.out, "run"),
        faults,
        max_steps=ns.max_steps,
        save_steps=4,
        use_cpu=False,
        bf16=True,
        learning_rate=1e-5,
    )
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)  # None: not launched with FSDP
    trainer.train()
    trainer.save_model(os.path.join(ns.out, "final"))  # FULL_STATE_DICT: gathered and written by rank 0
    result = {
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "state_dict_type": str(getattr(plugin, "state_dict_type", None)),
        "global_step": trainer.state.global_step,
        "injected": trainer.fault_injector.injected,
        "skipped": trainer.nan_guard.state.skipped_steps,
        "rollbacks": trainer.nan_guard.state.rollbacks,
    }
    if trainer.is_world_process_zero():
        with open(os.path.join(ns.out, "result.json"), "w") as f:
            json.dump(result, f)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
