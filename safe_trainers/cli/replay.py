"""`safe-trainers replay OUTPUT_DIR --step N`: replay a faulted step's bundle (`output_dir/nan_replay/step-N/`) on
the CPU from the checkpoint before it and print the first non-finite module and rows, beside the in-loop diagnosis
(docs/replay.md). Exit status: 0 when the replay ran (and agrees, or there is nothing to compare), 1 when it
disagrees with the in-loop diagnosis, 2 when there is nothing to replay (no bundle, no checkpoint before the step, or
one without loadable weights), 3 when the bundle holds no micro-batch to replay forward (a rollback the check of the
state found with no faulted step): its non-finite entries are written over the checkpoint and listed, no forward
runs; or a poisoned GRPO/RLOO step's bundle (prompts only, nothing to load or run)."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

NO_FORWARD = 3  # the exit status of a replay of a bundle without micro-batches (docs/replay.md)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "replay",
        help="Replay a faulted step's bundle (nan_replay/step-N) on the CPU and name the first non-finite module.",
    )
    parser.add_argument("output_dir", help="The run's `output_dir`.")
    parser.add_argument("--step", type=int, required=True, help="The step whose bundle to replay.")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from ..replay import bundle_steps
    from ..replay.report import agreement, report_lines
    from ..replay.rerun import checkpoint_before, loadable_weights, replay

    steps = bundle_steps(ns.output_dir)
    if ns.step not in steps:
        have = f"the steps with one: {', '.join(map(str, steps))}" if steps else "it has none"
        print(f"safe-trainers replay: `{ns.output_dir}` has no replay bundle for step {ns.step} ({have}). Pass "
              "`--step` one of those; bundles are written on `skip`, `rollback` and `poison` events while "
              "`nan_replay_max_bytes` > 0.", file=sys.stderr)  # fmt: skip
        return 2
    checkpoint = checkpoint_before(ns.output_dir, ns.step)
    if checkpoint is None:
        print(f"safe-trainers replay: `{ns.output_dir}` has no `checkpoint-K` with K < {ns.step} to replay step "
              f"{ns.step} from (rotated away by `save_total_limit`, or the run saved none before it).",
              file=sys.stderr)  # fmt: skip
        return 2
    if not loadable_weights(checkpoint):
        print(f"safe-trainers replay: `{checkpoint}` holds no model weights `from_pretrained` can load "
              "(`model.safetensors`, `pytorch_model.bin`, an adapter or their index): a DeepSpeed ZeRO-3 run writes "
              "them with `stage3_gather_16bit_weights_on_model_save: true`, an FSDP run with a "
              "full state dict (`state_dict_type` `FULL_STATE_DICT`).", file=sys.stderr)  # fmt: skip
        return 2
    _quiet()
    with warnings.catch_warnings():  # TRL's DPO loss reads a property recent transformers deprecate (see the demo)
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        result = replay(os.path.abspath(ns.output_dir), ns.step, checkpoint)
    print("\n".join(report_lines(result)))
    if not result.forward:
        return NO_FORWARD
    return 1 if agreement(result.found, result.meta.get("in_loop_diagnosis")) is False else 0


def _quiet() -> None:
    """transformers' and datasets' progress bars and notices off: the replay prints its own lines."""
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
