"""The GPU proof: the seed failures on real kernels, fp16 with a real loss scaler, FSDP2, host syncs per step.

Every test in this directory needs a CUDA GPU and is skipped without one (they are written for one H100):

    python -m pytest tests/gpu -q

Run them alone, as above: the lock below keeps them one at a time, but in a whole-suite run on a GPU machine the other
worker's trainer tests (which take the GPU when there is one) could share the device with a timing test.

What the stock TRL runs did where their failure is not deterministic is recorded (`record_property`, and printed:
add `-rP` to see it), not asserted; the safe side is asserted strictly.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import torch


HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def one_test_on_the_device(tmp_path_factory):
    """The tests here time steps and copies on the one device: under pytest-xdist (the suite's two workers) each holds
    an exclusive lock for its duration, so no other GPU test runs beside it. A file lock, not an `xdist_group`: the
    group is silently ignored with pytest 9.2 (pytest-dev/pytest-xdist#1386)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder
    with open(shared / "device.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
    # A conftest hook sees the whole session's items: mark only this directory's.
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu)")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
