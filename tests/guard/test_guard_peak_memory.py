"""What the guard adds to a real run's peak memory: LoRA DPO over a bf16 base, the safe trainer with the guard on
and with it off, each trained in a fresh process (`bench/guard_memory.py`'s own measurement), peak resident memory.

The bound is the one `bench/guard_memory.py` prints for 1B bases: at most 5% of the base's bytes plus 64 MiB. The
base (71M parameters, 143 MB) is large enough that the guard before this bound (an fp32 copy of every tensor in each
check, and a copy of the frozen base in the snapshot: about 3x the base's bytes, 425 MB) clearly fails it, small
enough for the test to take tens of seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safe_trainers.testing.toy import build_model, build_tokenizer


BENCH = Path(__file__).resolve().parents[2] / "bench" / "guard_memory.py"
MIB = 2**20


def _peak(model: str, run: str, out: str) -> dict:
    spec = {"model": model, "method": "lora", "run": run, "out": out, "steps": 1, "batch": 1, "seq": 16}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--one", json.dumps({**spec, "targets": "default"})],
        env=env, capture_output=True, text=True, timeout=600, cwd=str(BENCH.parent),
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.slow  # a process of its own, or a real run
def test_the_guard_adds_at_most_5_percent_of_a_lora_base_plus_64_mib(tmp_path):
    shape = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=12)
    base = build_model("qwen2", num_key_value_heads=6, max_position_embeddings=4096, **shape).to(torch.bfloat16)
    path = str(tmp_path / "base")
    base.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    del base
    off = _peak(path, "safe, guard off", str(tmp_path / "off"))
    on = _peak(path, "safe, guard on", str(tmp_path / "on"))  # a snapshot after every step, each after a full check
    assert on["model_bytes"] > 140 * 10**6 and on["trainable"] < on["params"] / 100  # a bf16 base, LoRA adapters
    extra = on["peak"] - off["peak"]
    assert extra <= 0.05 * on["model_bytes"] + 64 * MIB, (extra / MIB, on, off)
    assert 0 < on["snapshot_bytes"] < 8 * MIB  # the adapters and their moments, not the base
