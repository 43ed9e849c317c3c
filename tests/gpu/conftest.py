"""The GPU proof: the seed failures on real kernels, fp16 with a real loss scaler, FSDP2, host syncs per step.

Every test in this directory needs a CUDA GPU and is skipped without one (they are written for one H100):

    python -m pytest tests/gpu -q

What the stock TRL runs did where their failure is not deterministic is recorded (`record_property`, and printed:
add `-rP` to see it), not asserted; the safe side is asserted strictly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # A conftest hook sees the whole session's items: mark only this directory's.
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu)")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
