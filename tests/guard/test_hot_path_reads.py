"""The CPU sync lint over a real trainer: the guard's per-step calls read no tensor back to the host, on healthy steps
and on a faulted one, with its defaults (the snapshot interval adapts: `due()` estimates and decides on its own).

`tests/guard/test_nan_guard.py` lints the guard's calls one faulted step at a time over a fake loop; this one runs a
real DPO trainer for the steps where the interval is first estimated and then taken, and watches every call of the
hot path (the trainer's hooks hand the guard the inputs, the loss and the gradient norm; its callback hands the skip
flag to the optimizer and asks at each step end whether an inspection is due). Inspections read the flags back by
design: they run outside the watched calls. On a GPU, `tests/gpu/test_gpu_host_syncs.py` watches the same calls for
CUDA synchronisations.
"""

from __future__ import annotations

from host_reads import HostReads  # tests/ is on sys.path

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault


HOT_PATH = ("record_inputs", "observe_loss", "end_of_step", "apply_skip", "due")
MAX_STEPS = 24
FAULT_STEP = 3


def watch(guard, names: tuple[str, ...]) -> dict[str, list[str]]:
    """Run each method `names` of `guard` inside a [`HostReads`] (the CPU sync lint): the reads by method."""
    reads: dict[str, list[str]] = {name: [] for name in names}

    def watched(name, method):
        def run(*args, **kwargs):
            with HostReads(reads[name]):
                return method(*args, **kwargs)

        return run

    for name in names:
        setattr(guard, name, watched(name, getattr(guard, name)))
    return reads


def test_the_guards_per_step_calls_read_nothing_back(toy_models, tmp_path):
    # The guard's defaults for the interval (`nan_snapshot_steps` unset, `nan_snapshot_budget=0.01`): it is first
    # estimated in `due()` at step 10, where the second snapshot would be taken. No log or save inspects before the end.
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, rows=2 * MAX_STEPS, max_steps=MAX_STEPS, logging_steps=MAX_STEPS,
        save_strategy="no", faults=[Fault(step=FAULT_STEP, kind="loss")],
    )  # fmt: skip
    assert trainer.nan_guard.interval.adaptive
    reads = watch(trainer.nan_guard, HOT_PATH)
    trainer.train()
    assert trainer.nan_guard.state.skipped_steps == 1  # the faulted step went through the hot path, skipped
    assert [e.kind for e in trainer.nan_guard.events.events if e.kind == "snapshot_interval"]  # `due()` estimated
    assert reads == {name: [] for name in HOT_PATH}
