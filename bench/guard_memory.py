"""Benchmark: what the NaN guard adds to a run's peak memory, full fine-tune and LoRA, as the model grows.

For each model size (Qwen2-style, built from a config, stored and loaded in bf16) and each method (a full fine-tune;
LoRA rank 16 on `q_proj` and `v_proj`, PEFT's default for this architecture, the base frozen), it trains the DPO
workload of `workload.py` three ways, each in a fresh process, so that one run's peak is not another's: stock TRL
(`trl.DPOTrainer`), `safe_trainers.DPOTrainer` with the guard off (`nan_guard=False`: the rules alone), and with the
guard on, taking a snapshot after every step (`nan_snapshot_steps=1, nan_snapshot_budget=0`; each is preceded by
the full finiteness check). The peak is the process's peak resident memory (`ru_maxrss`) on the CPU, and
`torch.cuda.max_memory_allocated()` when CUDA is present.

The guard's extra peak is guard on - guard off; it is printed as a fraction of the model's bytes (all parameters, the
frozen base included) and against the bound `5% of the model's bytes + 64 MiB`. On the CPU the peak also counts the
snapshot's host copy (its own column), which is the device's memory there too: a LoRA run's copy is its adapters'
weights and AdamW moments (12 bytes per adapter parameter, `--lora-targets all` makes it about 7% of a bf16 base's
bytes by itself); a full fine-tune's is the trainable weights and their two AdamW moments, 3x the model's bytes in
bf16. The last columns are what the guard holds beyond that copy, which the bound is about.

    python bench/guard_memory.py                         # the default sizes: a few tens of minutes on 2 cores
    python bench/guard_memory.py --sizes 1024x8 --methods lora
    python bench/guard_memory.py --ddp 2,3 --sizes 1024x8 --steps 2   # DDP on CPU ranks: the snapshot shared out

With `--ddp`, a full fine-tune under DDP on that many CPU ranks (gloo, `accelerate launch`), guard off and on, each
a fresh launch: the guard's extra peak per rank against S/N, S the snapshot one process holds (`ddp_memory.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# hidden size x layers: about 24M, 127M, 426M and 1.0B parameters (vocabulary 384, MLP 4x hidden, GQA).
FULL_SIZES = "512x6,1024x8,1536x12"
LORA_SIZES = "512x6,1024x8,1536x12,2048x16"
RUNS = ("stock", "safe, guard off", "safe, guard on")
LORA_TARGETS = {
    "default": ["q_proj", "v_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
MIB = 2**20
BOUND_SHARE, BOUND_BYTES = 0.05, 64 * MIB


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full-sizes", default=FULL_SIZES, help="HIDDENxLAYERS sizes of the full fine-tunes")
    parser.add_argument("--lora-sizes", default=LORA_SIZES, help="HIDDENxLAYERS sizes of the LoRA runs")
    parser.add_argument("--sizes", help="the same sizes for both methods (overrides the two above)")
    parser.add_argument("--methods", default="full,lora", help="comma-separated: full, lora")
    parser.add_argument("--seq", type=int, default=32, help="about this many tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--lora-targets", choices=sorted(LORA_TARGETS), default="default")
    parser.add_argument("--ddp", help="comma-separated rank counts: the DDP mode (full fine-tune, CPU ranks)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="the DDP mode's rendezvous port, for every launch in turn (default: the OS's pick each)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a JSON measurement to run in this process
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------- one measurement
def measure_one(spec: dict) -> dict:
    """Train one run in this process and return its peak memory (called in a fresh process by [`measure`])."""
    import torch
    import trl
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from workload import dataset, quiet, snapshot_bytes

    from safe_trainers.testing.build import build_trainer

    quiet()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kwargs = {}
    if spec["method"] == "lora":
        lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS[spec["targets"]])
        kwargs["trainer_kwargs"] = {"peft_config": lora}
    if spec["run"] == "stock":
        kwargs.update(trainer_cls=trl.DPOTrainer, config_cls=trl.DPOConfig)
    elif spec["run"] == "safe, guard off":
        kwargs["nan_guard"] = False
    else:
        kwargs.update(nan_snapshot_steps=1, nan_snapshot_budget=0.0)  # exactly every step
    cuda = torch.cuda.is_available()
    ranks = spec.get("ranks", 1)  # the DDP mode: every rank trains its own batches
    trainer = build_trainer(
        "dpo",
        model,
        spec["out"],
        dataset=dataset(spec["steps"] * spec["batch"] * ranks, spec["seq"]),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch"],
        logging_steps=1,
        save_strategy="no",
        precompute_ref_log_probs=False,
        bf16=cuda,
        **kwargs,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    guard = getattr(trainer, "nan_guard", None)
    held = snapshot_bytes(guard.snapshotter.snapshot) if guard is not None and guard.snapshotter else 0
    if ranks > 1:
        return ddp_result(trainer, peak, model_bytes)
    return {
        "peak": peak,
        "memory": "CUDA max_memory_allocated" if cuda else "peak RSS",
        "model_bytes": model_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "seconds": time.perf_counter() - start,
        "snapshot_bytes": held,
        "snapshot_on_device": not cuda,  # on the CPU the host copy is in the measured memory
    }


def run_child(spec: dict) -> dict:
    """Run [`measure_one`] (or `spec["build"]`) in a fresh Python process; return what it printed."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")
    cmd = [*spec.get("launcher", [sys.executable]), os.path.abspath(__file__), "--one", json.dumps(spec)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=HERE)
    if "results" in spec:  # DDP: a file per rank (their stdout interleaves); a gloo rank may abort at exit after it
        files = sorted(os.listdir(spec["results"]))
        if len(files) < spec["ranks"]:
            raise RuntimeError(f"measurement {spec} failed:\n{(done.stdout + done.stderr)[-3000:]}")
        return {"ranks": [json.load(open(os.path.join(spec["results"], f))) for f in files]}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"measurement {spec} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def child_main(spec: dict) -> int:
    if "build" in spec:
        import torch
        from workload import build_model_dir

        hidden, layers = spec["build"]
        result = {"model": build_model_dir(spec["root"], hidden, layers, dtype=torch.bfloat16)}
    else:
        result = measure_one(spec)
    if "results" in spec:
        with open(os.path.join(spec["results"], f"rank-{result['rank']}.json"), "w") as f:
            json.dump(result, f)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- the table
def measure(ns, method: str, size: str, root: str) -> dict[str, dict]:
    """The three runs of one method and size, each in a fresh process."""
    hidden, layers = (int(v) for v in size.split("x"))
    model_root = os.path.join(root, size)
    model = run_child({"build": [hidden, layers], "root": model_root})["model"]
    results = {}
    for run in RUNS:
        out = os.path.join(root, "out")
        spec = {"model": model, "method": method, "run": run, "out": out, "steps": ns.steps, "batch": ns.batch}
        results[run] = run_child({**spec, "seq": ns.seq, "targets": ns.lora_targets})
        shutil.rmtree(out, ignore_errors=True)
        print(f"measured {method} {size} {run}: {results[run]['peak'] / MIB:,.0f} MiB", file=sys.stderr, flush=True)
    shutil.rmtree(model_root, ignore_errors=True)
    return results


def row(method: str, results: dict[str, dict]) -> tuple:
    stock, off, on = (results[run] for run in RUNS)
    model_bytes = on["model_bytes"]
    extra = on["peak"] - off["peak"]
    copy = on["snapshot_bytes"] if on["snapshot_on_device"] else 0
    bound = BOUND_SHARE * model_bytes + BOUND_BYTES
    return (
        f"{on['params'] / 1e6:,.0f}M",
        method,
        f"{on['trainable'] / 1e6:,.1f}M",
        f"{model_bytes / MIB:,.0f}",
        f"{stock['peak'] / MIB:,.0f}",
        f"{off['peak'] / MIB:,.0f}",
        f"{on['peak'] / MIB:,.0f}",
        f"{(on['peak'] - stock['peak']) / MIB:+,.0f}",
        f"{extra / MIB:+,.0f}",
        f"{extra / model_bytes:+.3f}",
        f"{on['snapshot_bytes'] / MIB:,.1f}",
        f"{(extra - copy) / MIB:+,.0f}",
        f"{(extra - copy) / model_bytes:+.3f}",
        f"{bound / MIB:,.0f}",
        "yes" if extra - copy <= bound else "NO",
    )


HEADER = [
    "parameters",
    "method",
    "trainable",
    "model (MiB)",
    "stock peak (MiB)",
    "safe, guard off (MiB)",
    "safe, guard on (MiB)",
    "safe - stock (MiB)",
    "guard extra (MiB)",
    "guard extra / model",
    "snapshot held (MiB)",
    "beyond the snapshot (MiB)",
    "beyond / model",
    "bound: 5% + 64 MiB",
    "within",
]


def main(argv=None) -> int:
    ns = parse(argv)
    if ns.one:
        return child_main(json.loads(ns.one))
    if ns.ddp:
        return ddp_main(ns, run_child)
    from workload import device_name, markdown_table

    sizes = {"full": ns.sizes or ns.full_sizes, "lora": ns.sizes or ns.lora_sizes}
    root = tempfile.mkdtemp(prefix="guard-memory-")
    start = time.perf_counter()
    rows, memory = [], "peak memory"
    try:
        for method in ns.methods.split(","):
            for size in sizes[method].split(","):
                results = measure(ns, method, size, root)
                rows.append(row(method, results))
                memory = results["stock"]["memory"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\nDPO, bf16 weights, batch {ns.batch}, ~{ns.seq} tokens, {ns.steps} steps, {device_name()}; LoRA r=16 on "
        f"{', '.join(LORA_TARGETS[ns.lora_targets])}; each run in a fresh process, memory = {memory}; the guard on "
        f"takes a snapshot after every step. MiB = 2^20 bytes. The bench took {time.perf_counter() - start:.0f} s.\n"
    )
    print(markdown_table(HEADER, rows))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    from ddp_memory import ddp_main, ddp_result

    sys.exit(main())
