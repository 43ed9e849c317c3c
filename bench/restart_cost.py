"""Benchmark: what a crash costs under torchrun's elastic agent, and what the per-step bookkeeping costs.

1. Restart: `safe_trainers.DPOTrainer` trains under `torchrun --max-restarts 1`, saving every `--save-steps`; the
   process SIGKILLs itself when step `--kill-step` begins. The elastic agent starts it again with the same command and
   `train()` resumes from the newest complete and finite checkpoint. Every phase is timed from timestamps the worker
   writes (wall clock): kill -> new process, imports and trainer construction, checkpoint choice and load -> first
   step, the first step, and the steps lost (done before the kill, after the checkpoint, done again).
2. Checking a checkpoint: the time to choose a synthetic checkpoint of `--scan-mb` MB of weights (its weights and
   optimizer state are read back and tested), as a rate in MB/s.
3. Bookkeeping: the step record (`output_dir/.safe_trainers_progress.json`) is rewritten when each step begins and
   ends; the time of one such write is measured here, on the filesystem of `--dir`.

    python bench/restart_cost.py                                   # CPU: a 1M-parameter model, ~0.1 s steps here
    python bench/restart_cost.py --hidden 1024 --layers 8 --dir /path/on/the/training/filesystem
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from functools import partial

from marks import at, launch_elastic, marker, read_marks, restart_count

STARTED = time.time()  # before any heavy import: the process start as the worker sees it


def worker(ns) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import TrainerCallback

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import safe_trainers as st
    from guard_overhead import dataset
    from safe_trainers.testing.quick import quick_args

    attempt = restart_count()
    mark = marker(os.path.join(ns.root, "marks.jsonl"))

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            step = state.global_step + 1
            if attempt == 0 and step == ns.kill_step:
                mark("kill", step)
                os.kill(os.getpid(), signal.SIGKILL)
            mark("step_begin", step)

        def on_step_end(self, args, state, control, **kwargs):
            mark("step_end", state.global_step)

    mark("process_start", t=STARTED)
    args = st.DPOConfig(**quick_args(
        output_dir=os.path.join(ns.root, "run"), max_steps=ns.kill_step + 2, save_strategy="steps",
        save_steps=ns.save_steps, per_device_train_batch_size=ns.batch, learning_rate=1e-5, logging_steps=10,
        precompute_ref_log_probs=False,
    ))  # fmt: skip
    trainer = st.DPOTrainer(ns.model, args=args, train_dataset=dataset(4 * ns.kill_step * ns.batch, ns.seq))
    trainer.add_callback(Clock())
    mark("built")
    trainer.train()
    mark("finished")
    return 0


def measure_restart(ns, root: str, model_dir: str) -> None:
    args = [
        "--root", root, "--model", model_dir, "--kill-step", str(ns.kill_step), "--save-steps", str(ns.save_steps),
        "--batch", str(ns.batch), "--seq", str(ns.seq),
    ]  # fmt: skip
    launch_elastic(__file__, 1, args)
    when = partial(at, read_marks(os.path.join(root, "marks.jsonl")))  # when(attempt, event, step=None)

    from workload import time_table

    from safe_trainers.restarts.checkpoint_choice import choose_checkpoint

    start = time.perf_counter()
    choose_checkpoint(os.path.join(root, "run"))
    scan = time.perf_counter() - start
    checkpoint = (ns.kill_step - 1) // ns.save_steps * ns.save_steps
    lost = ns.kill_step - 1 - checkpoint
    steps = [when(0, "step_end", s) - when(0, "step_begin", s) for s in range(2, ns.kill_step)]
    first, step, killed = checkpoint + 1, statistics.median(steps), when(0, "kill")
    rows = [
        ("kill -> new process started by the agent", when(1, "process_start") - killed),
        ("imports + trainer construction (rules, model, data)", when(1, "built") - when(1, "process_start")),
        ("train() -> first step: checkpoint choice, load, data skip", when(1, "step_begin", first) - when(1, "built")),
        ("  of which choosing the checkpoint (finiteness scan)", scan),
        (f"steps lost: {lost}, done again (steps {first}-{ns.kill_step - 1})", lost * step),
        ("total: kill -> the step that was killed begins again", when(1, "step_begin", ns.kill_step) - killed),
    ]
    print(f"\nRestart after a SIGKILL at step {ns.kill_step}, checkpoints every {ns.save_steps} steps "
          f"(resumes from checkpoint-{checkpoint}); a step takes {step * 1e3:.1f} ms\n")
    print(time_table(rows))


def measure_bookkeeping(ns, directory: str) -> None:
    from workload import time_table

    from safe_trainers.restarts.progress import Death, History, ProgressWriter

    agent = "5d874e25-f50b-4ac4-b837-9d13bdd45170@node-0:/tmp/torchelastic_lbzy4e5p/5d874e25-f50b-4ac4-b837_nq1o0xd0"
    history = History(3, (Death(0, 1200), Death(1, 1234), Death(2, 1234)), launch=(agent,), restart=3,
                      checkpoints=(1000, 1100, 1200), origin=None)  # fmt: skip
    writer = ProgressWriter(directory, history, "world=8 batch=4 accumulation=8 seed=42 data_seed=None rows=100000")
    times = []
    for step in range(ns.writes):
        start = time.perf_counter()
        writer.write(step, "step" if step % 2 else "between")
        times.append(time.perf_counter() - start)
    writer.close()
    write, p99 = statistics.median(times), sorted(times)[int(0.99 * len(times))]
    print(f"\nStep record: {ns.writes} writes on {directory} (median; p99 {p99 * 1e6:.1f} us)\n")
    print(time_table([("one write", write), ("per optimizer step (2 writes)", 2 * write)], unit="us"))


def measure_scan(ns, root: str) -> None:
    """How fast a checkpoint is checked (weights and optimizer state read back, every value tested), on a synthetic
    checkpoint of `--scan-mb` MB of weights and twice that of optimizer state, as AdamW keeps."""
    import torch
    from safetensors.torch import save_file
    from workload import time_table

    from safe_trainers.restarts.completeness import incomplete_checkpoint
    from safe_trainers.restarts.checkpoint_choice import checkpoint_problem

    path = os.path.join(root, "scan", "checkpoint-1")
    os.makedirs(path)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        f.write('{"global_step": 1}')
    n = max(ns.scan_mb // 16, 1)  # 16 MB fp32 tensors
    weights = {f"layer{i}.weight": torch.randn(2048, 2048) for i in range(n)}
    save_file(weights, os.path.join(path, "model.safetensors"))
    state = {i: {"exp_avg": torch.randn(2048, 2048), "exp_avg_sq": torch.rand(2048, 2048)} for i in range(n)}
    optimizer = {"state": state, "param_groups": [{"lr": 1e-5, "params": list(range(n))}]}
    torch.save(optimizer, os.path.join(path, "optimizer.pt"))
    del weights, state, optimizer
    times, headers = [], []
    for _ in range(3):
        start = time.perf_counter()
        assert checkpoint_problem(path) is None
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert incomplete_checkpoint(path) is None
        headers.append(time.perf_counter() - start)
    scan = statistics.median(times)
    print(f"\nChecking a checkpoint: {n * 16} MB of weights + {n * 32} MB of optimizer state (page cache warm)\n")
    print(time_table([("choosing it (completeness + finiteness)", scan)]))
    print()
    print(time_table([("of which completeness (JSON, headers, sizes)", statistics.median(headers))], unit="us"))
    print(f"\n= {n * 48 / scan:.0f} MB/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--kill-step", type=int, default=16, help="the step whose start is killed (attempt 0)")
    parser.add_argument("--writes", type=int, default=2000, help="step-record writes to time")
    parser.add_argument("--scan-mb", type=int, default=256, help="weights (MB) of the synthetic checkpoint to check")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.worker:
        return worker(ns)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from guard_overhead import build_model_dir

    root = tempfile.mkdtemp(prefix="restart-bench-", dir=ns.dir)
    try:
        measure_bookkeeping(ns, root)
        measure_scan(ns, root)
        measure_restart(ns, root, build_model_dir(root, ns.hidden, ns.layers))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
