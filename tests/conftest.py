"""Shared fixtures: tiny models saved to disk (built locally, no network), toy datasets, quiet offline HF."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


# No Hub access in tests: every model and tokenizer is built locally and loaded from a directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs on pytest-xdist workers (pyproject.toml's `addopts`): one torch thread each, set before torch is
# imported, so that two workers' thread pools do not fight over the cores (the tiny models gain nothing from more).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from safe_trainers.testing.toy import save_toy_model  # noqa: E402


@pytest.fixture(scope="session")
def toy_models(tmp_path_factory) -> dict[str, str]:
    """Paths of tiny saved models: `{family}` causal LMs and `{family}-rm` sequence classifiers (1 label)."""
    root = tmp_path_factory.mktemp("toy-models")
    paths = {}
    for family in ("qwen2", "llama", "gemma2", "gemma3"):
        paths[family] = save_toy_model(str(root / family), family)
    for family in ("qwen2", "gemma2"):
        paths[f"{family}-rm"] = save_toy_model(str(root / f"{family}-rm"), family, task="seq_cls")
    return paths


# Property-based tests (tests/guard/test_guard_properties.py): five derandomized examples per trainer kind by default,
# so CI is repeatable; `python -m pytest --hypothesis-profile=long tests/guard/test_guard_properties.py` explores many
# more.
from hypothesis import HealthCheck, settings  # noqa: E402

_SLOW_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=5, derandomize=True, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile("long", max_examples=25, deadline=None, suppress_health_check=_SLOW_OK)
settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def _remove_deepspeed_shared_memory():
    """DeepSpeed's CPU accelerator keeps its all-reduce buffers in `/dev/shm` (two 66 MB files per two-process launch)
    and never removes them, so a whole suite would leave gigabytes of RAM behind. At the session's end (each xdist
    worker's), remove the ones created since it began that no live process maps: a launch of another worker, or of
    another session on the machine, still running keeps its buffers."""
    shm = Path("/dev/shm")
    pattern = "deepspeed_allreduce_buffer_*"
    before = set(shm.glob(pattern)) if shm.is_dir() else set()
    yield
    created = set(shm.glob(pattern)) - before if shm.is_dir() else set()
    for path in created - mapped_files(created):
        path.unlink(missing_ok=True)


def mapped_files(paths: set[Path]) -> set[Path]:
    """Those of `paths` that a live process maps (read from every readable `/proc/<pid>/maps`)."""
    names = {str(path) for path in paths}
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps") if names else ():
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        mapped.update(name for name in names if name in text)
    return {Path(name) for name in mapped}


@pytest.fixture
def config_only_model(toy_models, tmp_path):
    """A model directory with only a valid `config.json`: loading weights from it raises OSError."""
    path = tmp_path / "config-only"
    path.mkdir()
    shutil.copy(os.path.join(toy_models["qwen2"], "config.json"), path / "config.json")
    return str(path)


def pytest_collection_modifyitems(config, items):
    """`slow` marks every test that trains a real trainer (it asks for the tiny saved models, `toy_models`) or
    launches processes (`distributed`), on top of the modules that mark themselves: `python -m pytest -m "not slow"`
    runs the rest, the unit tests, in a few minutes; CI runs everything (`python -m pytest`)."""
    for item in items:
        if "toy_models" in item.fixturenames or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)
