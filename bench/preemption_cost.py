"""Benchmark: what a preemption and a hang cost under torchrun's elastic agent (`docs/guard.md#preemption-and-hangs`).

1. Preemption: `safe_trainers.DPOTrainer` trains under `torchrun --max-restarts 1`; when step `--signal-step` begins,
   rank `--signal-rank` sends itself SIGTERM (as Kubernetes or SLURM would). Every rank finishes its step(s), the
   checkpoint of the agreed step is published and the process exits with status 75; the agent starts it again and
   `train()` resumes. Timed from wall-clock marks the worker writes: signal -> checkpoint published, signal -> process
   exit, signal -> the next step begins in the restarted process, and the steps lost (trained twice).
2. Hang: the process sleeps forever when step `--hang-step` begins (attempt 0). The watchdog (`hang_timeout`, here
   `--hang-timeout` seconds: the bound before it is learned, and its ceiling) writes the stacks and exits with status
   124; the agent restarts it from the newest checkpoint. Timed: hang -> stacks written, hang -> the hung step begins
   again in the restarted process.
3. Cost: the same DPO run in this process with stock TRL, with the guard as shipped (preemption handling and the
   watchdog on), and with the guard but `preempt_signals=[]`, `hang_timeout=0`; interleaved rounds of whole `train()`
   calls (CPU time of the process with `--cpu-time`, steadier on a shared machine); the headline is the ratio of the
   summed whole-run times, the per-step median ratio beside it (no synchronisation per step).

    python bench/preemption_cost.py                       # CPU: a 1M-parameter model, ~0.1 s steps here
    python bench/preemption_cost.py --ranks 2             # DDP on 2 processes, the signal to rank 1 only
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

from marks import at, launch_elastic, marker, read_marks, restart_count

STARTED = time.time()  # before any heavy import: the process start as the worker sees it


def worker(ns) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import atexit

    from transformers import TrainerCallback

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import safe_trainers as st
    from guard_overhead import dataset
    from safe_trainers.testing.quick import quick_args

    attempt, rank = restart_count(), int(os.environ.get("RANK", "0"))
    mark = marker(os.path.join(ns.root, f"marks-rank{rank}.jsonl"))

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            step = state.global_step + 1
            mark("step_begin", step)
            if attempt == 0 and step == ns.signal_step and rank == ns.signal_rank:
                mark("signal", step)
                os.kill(os.getpid(), signal.SIGTERM)
            if attempt == 0 and step == ns.hang_step:
                mark("hang", step)
                while True:
                    time.sleep(3600)

        def on_step_end(self, args, state, control, **kwargs):
            mark("step_end", state.global_step)

        def on_save(self, args, state, control, **kwargs):
            mark("saved", state.global_step)

    atexit.register(lambda: mark("exit"))
    mark("process_start", t=STARTED)
    last = max(ns.signal_step, ns.hang_step) + 2
    args = st.DPOConfig(**quick_args(
        output_dir=os.path.join(ns.root, "run"), max_steps=last, save_strategy="steps", save_steps=ns.save_steps,
        per_device_train_batch_size=ns.batch, learning_rate=1e-5, logging_steps=10, precompute_ref_log_probs=False,
        hang_timeout=ns.hang_timeout,
    ))  # fmt: skip
    trainer = st.DPOTrainer(ns.model, args=args, train_dataset=dataset(4 * last * ns.batch * ns.nproc, ns.seq))
    trainer.add_callback(Clock())
    trainer.train()
    return 0


def run(ns, root: str, model_dir: str, *extra: str) -> list[dict]:
    os.makedirs(root)
    args = [
        "--root", root, "--model", model_dir, "--save-steps", str(ns.save_steps), "--batch", str(ns.batch),
        "--seq", str(ns.seq), "--ranks", str(ns.nproc), "--hang-timeout", str(ns.hang_timeout), *extra,
    ]  # fmt: skip
    launch_elastic(__file__, ns.nproc, args, {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return read_marks(os.path.join(root, "marks-rank0.jsonl"))


def step_time(marks: list[dict], last: int) -> float:
    times = sorted(at(marks, 0, "step_end", s) - at(marks, 0, "step_begin", s) for s in range(2, last))
    return times[len(times) // 2]


def measure_preemption(ns, root: str, model_dir: str) -> None:
    from workload import time_table

    extra = ["--signal-step", str(ns.signal_step), "--signal-rank", str(ns.nproc - 1), "--hang-step", "0"]
    marks = run(ns, os.path.join(root, "preempt"), model_dir, *extra)
    sent = at(read_marks(os.path.join(root, "preempt", f"marks-rank{ns.nproc - 1}.jsonl")), 0, "signal")
    saved = max(m["step"] for m in marks if m["attempt"] == 0 and m["event"] == "saved")
    first = min(m["step"] for m in marks if m["attempt"] == 1 and m["event"] == "step_begin")
    trained = [m["step"] for m in marks if m["attempt"] == 0 and m["event"] == "step_end"]
    lost = sum(1 for m in marks if m["attempt"] == 1 and m["event"] == "step_end" and m["step"] in trained)
    rows = [
        (f"signal (step {ns.signal_step} begins) -> checkpoint-{saved} published",
         at(marks, 0, "saved", saved) - sent),
        ("signal -> process exit (status 75)", at(marks, 0, "exit") - sent),
        (f"signal -> restarted process begins step {first}", at(marks, 1, "step_begin", first) - sent),
    ]
    step = step_time(marks, ns.signal_step)
    print(f"\nPreemption: SIGTERM to rank {ns.nproc - 1} of {ns.nproc} as step {ns.signal_step} begins; a step takes "
          f"{step * 1e3:.1f} ms; steps lost (trained twice): {lost}\n")  # fmt: skip
    print(time_table(rows))


def measure_hang(ns, root: str, model_dir: str) -> None:
    from workload import time_table

    marks = run(ns, os.path.join(root, "hang"), model_dir, "--hang-step", str(ns.hang_step), "--signal-step", "0")
    hung = at(marks, 0, "hang")
    stacks = os.path.getmtime(os.path.join(root, "hang", "run", "hang-stacks-rank0.txt"))
    checkpoint = (ns.hang_step - 1) // ns.save_steps * ns.save_steps
    rows = [
        (f"hang (step {ns.hang_step}) -> stacks written, exit 124", stacks - hung),
        ("hang -> new process started by the agent", at(marks, 1, "process_start") - hung),
        (f"hang -> step {ns.hang_step} begins again (from checkpoint-{checkpoint})",
         at(marks, 1, "step_begin", ns.hang_step) - hung),
    ]  # fmt: skip
    step = step_time(marks, ns.hang_step)
    print(f"\nHang: every rank of {ns.nproc} sleeps forever in step {ns.hang_step}; "
          f"`hang_timeout={ns.hang_timeout:g}` "
          f"(the bound until it is learned); a step takes {step * 1e3:.1f} ms\n")  # fmt: skip
    print(time_table(rows))


def measure_overhead(ns, root: str, model_dir: str) -> None:
    import statistics

    import trl
    from workload import StepTimer, dataset, markdown_table, quiet, release, timed_train

    from safe_trainers.testing.build import build_trainer

    quiet()
    data = dataset(ns.overhead_steps * ns.batch, ns.seq)
    configs = {
        "stock TRL": dict(trainer_cls=trl.DPOTrainer, config_cls=trl.DPOConfig),
        "guard, preemption and watchdog on (defaults)": {},
        "guard, `preempt_signals=[]`, `hang_timeout=0`": dict(preempt_signals=[], hang_timeout=0),
    }
    medians: dict[str, list[float]] = {name: [] for name in configs}
    whole: dict[str, list[float]] = {name: [] for name in configs}
    for round_index in range(ns.rounds):
        names = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        for name in names:
            trainer = build_trainer(
                "dpo", model_dir, os.path.join(root, f"overhead{round_index}-{len(medians[name])}"), dataset=data,
                max_steps=ns.overhead_steps, per_device_train_batch_size=ns.batch, logging_steps=10,
                precompute_ref_log_probs=False, save_strategy="no", **configs[name],
            )  # fmt: skip
            clock = time.process_time if ns.cpu_time else time.perf_counter
            timer = StepTimer(clock)  # no synchronisation per step (CUDA events on a GPU)
            trainer.add_callback(timer)
            whole[name].append(timed_train(trainer, clock))
            medians[name].append(statistics.median(timer.times[2:]))
            del trainer
            release()
    stock = medians["stock TRL"]
    clock = "CPU time" if ns.cpu_time else "wall time"
    print(f"\nCost, 1 process, {ns.rounds} interleaved rounds of one whole `train()` call of {ns.overhead_steps} steps "
          f"({clock}); headline: the summed whole-run times, ratio to stock TRL; beside it the per-step median ratio "
          f"(the median over rounds of the median step's ratio)\n")
    rows = []
    for name, values in medians.items():
        run_ratio = sum(whole[name]) / sum(whole["stock TRL"])
        ratio = statistics.median(v / s for v, s in zip(values, stock))
        rows.append((name, f"{statistics.mean(whole[name]):.2f}", f"{run_ratio:.3f}",
                     f"{statistics.median(values) * 1e3:.1f}", f"{ratio:.3f}"))  # fmt: skip
    header = ["run", "whole run (s)", "whole run, ratio to stock TRL", "step (ms)", "per-step median ratio"]
    print(markdown_table(header, rows))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ranks", dest="nproc", type=int, default=1)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--signal-step", type=int, default=16)
    parser.add_argument("--signal-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--hang-step", type=int, default=16)
    parser.add_argument("--hang-timeout", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the per-step cost")
    parser.add_argument("--overhead-steps", type=int, default=30)
    parser.add_argument("--cpu-time", action="store_true", help="time steps in CPU time (a shared CPU machine)")
    parser.add_argument("--only", choices=["overhead", "restarts"], default=None, help="run one part")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.worker:
        return worker(ns)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from guard_overhead import build_model_dir

    root = tempfile.mkdtemp(prefix="preemption-bench-", dir=ns.dir)
    try:
        model_dir = build_model_dir(root, ns.hidden, ns.layers)
        if ns.only != "restarts":
            measure_overhead(ns, root, model_dir)
        if ns.only != "overhead":
            measure_preemption(ns, root, model_dir)
            measure_hang(ns, root, model_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
