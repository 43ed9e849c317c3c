"""The run `safe-trainers check` lints for: its hardware, its process count, and the config fields the user set.

The lint runs where the run is planned, not where it trains. transformers validates a few fields against the machine
that parses the config (`tf32` needs an Ampere GPU, `ddp_backend="nccl"` needs CUDA), and TRL derives the GRPO/RLOO
generation batch from the number of processes. So those fields are held aside while parsing and judged here for the
target instead, and the config is parsed as it would be by each of the target's processes, without setting up this
machine's devices (no accelerate state, process group or CUDA context).

The lint runs nothing the config would: TRL's `env:` mapping, which TRL's parser applies to the process that parses,
is held aside too and only reported.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..redact import shown
from ..rules.hardware import BF16_MIN_CAPABILITY, Hardware, gpu_capability


# Fields transformers validates against the machine that parses the config; `check` judges them for the target.
TARGET_FIELDS: tuple[str, ...] = ("tf32", "ddp_backend")
CUDA_ONLY_BACKENDS = frozenset({"nccl"})


@dataclass(frozen=True)
class Launch:
    """How many processes the run is launched with, and where that was read.

    Args:
        num_processes (`int`): the total number of training processes (accelerate's `num_processes`: all machines).
        num_machines (`int`): the number of machines.
        source (`str`): where the count comes from, for the report.
    """

    num_processes: int = 1
    num_machines: int = 1
    source: str = "not stated: set it with `--num-processes` or `--accelerate-config`"

    def describe(self) -> str:
        machines = f" on {self.num_machines} machines" if self.num_machines > 1 else ""
        plural = "es" if self.num_processes != 1 else ""
        return f"{self.num_processes} process{plural}{machines} ({self.source})"


def read_yaml(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"`{path}` does not hold a mapping of settings.")
    return data


def launch_from(accelerate_config: dict[str, Any] | None, num_processes: int | None) -> Launch:
    """The launch: `--num-processes` wins over the accelerate config's `num_processes`; one process otherwise."""
    machines = int((accelerate_config or {}).get("num_machines") or 1)
    if num_processes is not None:
        return Launch(num_processes, machines, "`--num-processes`")
    if accelerate_config and accelerate_config.get("num_processes"):
        return Launch(int(accelerate_config["num_processes"]), machines, "`num_processes` of `--accelerate-config`")
    return Launch(num_machines=machines)


def explicit_fields(config: dict[str, Any], overrides: Sequence[str]) -> frozenset[str]:
    """The fields the user set: the YAML's keys and the `--name`/`--name=value` overrides."""
    flags = {arg[2:].split("=", 1)[0] for arg in overrides if arg.startswith("--") and len(arg) > 2}
    return frozenset(config) | frozenset(flag.replace("-", "_") for flag in flags)


def hold_target_fields(config: dict[str, Any], overrides: Sequence[str]) -> tuple[dict, list[str], dict[str, Any]]:
    """Split the fields of `TARGET_FIELDS` out of the YAML and the overrides (an override wins). Pure.

    Returns:
        `(config without them, overrides without them, {field: value as given})`.
    """
    held = {name: config[name] for name in TARGET_FIELDS if name in config}
    rest = {key: value for key, value in config.items() if key not in TARGET_FIELDS}
    kept: list[str] = []
    args = list(overrides)
    i = 0
    while i < len(args):
        name, has_value, value = args[i][2:].partition("=") if args[i].startswith("--") else ("", False, "")
        name = name.replace("-", "_")
        if name in TARGET_FIELDS:
            if not has_value:
                i += 1
                value = args[i] if i < len(args) else ""
            held[name] = value
        else:
            kept.append(args[i])
        i += 1
    return rest, kept, held


def hold_env(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split TRL's `env:` mapping out of the config, so that parsing it sets no environment variable here. Pure.

    Returns:
        `(config without it, {variable: value})`.

    Raises:
        ValueError: when `env` is not a mapping (TRL's parser refuses it too).
    """
    env = config.get("env", {})
    if not isinstance(env, dict):
        raise ValueError(
            f"`env={shown('env', env)}` in the `--config` file is not a mapping of environment variables. Write one "
            "`NAME: value` line per variable under `env:`, or remove it."
        )
    return {key: value for key, value in config.items() if key != "env"}, dict(env)


def env_note(env: dict[str, Any]) -> str | None:
    """The line saying what the config's `env:` would set, credentials hidden; `None` without one. Pure."""
    if not env:
        return None
    listed = ", ".join(f"`{name}={shown(str(name), str(value))}`" for name, value in env.items())
    return (f"`env:` in the `--config` file was not applied by the check (the launch scripts apply it, as TRL does): "
            f"{listed}.")  # fmt: skip


def as_bool(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    if text == "none":
        return None
    raise ValueError(f"`tf32` takes true or false, got {value!r}.")


def target_values(held: dict[str, Any]) -> dict[str, Any]:
    """The held fields as the config stores them (`tf32` a bool or `None`, `ddp_backend` a string or `None`)."""
    values = dict(held)
    if "tf32" in values:
        values["tf32"] = as_bool(values["tf32"])
    if "ddp_backend" in values and values["ddp_backend"] is not None:
        values["ddp_backend"] = str(values["ddp_backend"])
    return values


def target_problems(values: dict[str, Any], hardware: Hardware) -> list[str]:
    """What the target would refuse at start-up among the held fields (empty when it takes them all). Pure."""
    problems = []
    cuda = hardware.accelerator == "cuda"
    capability = gpu_capability(hardware.device_name) if hardware.device_name else None
    ampere = cuda and (capability >= BF16_MIN_CAPABILITY if capability is not None else hardware.bf16_supported)
    if values.get("tf32") and not ampere:
        problems.append(
            f"`tf32=True` needs an NVIDIA GPU of the Ampere generation or newer, and the target is "
            f"{hardware.device_name or hardware.accelerator.upper()}: transformers refuses the config at start-up "
            "there. Remove `tf32` or set it to false."
        )
    backend = values.get("ddp_backend")
    if backend in CUDA_ONLY_BACKENDS and not cuda:
        problems.append(
            f"`ddp_backend={backend!r}` needs CUDA GPUs, and the target is {hardware.accelerator.upper()}. Use "
            "`ddp_backend: gloo`, or leave it unset for the platform's default."
        )
    return problems


@contextmanager
def config_file(config: dict[str, Any]) -> Iterator[str]:
    """`config` written to a temporary YAML file, removed afterwards."""
    import yaml

    handle, path = tempfile.mkstemp(suffix=".yaml", prefix="safe-trainers-check-")
    try:
        with os.fdopen(handle, "w") as f:
            yaml.safe_dump(config, f)
        yield path
    finally:
        os.unlink(path)


class LintDevices:
    """The devices of a config parsed for the target, not set up on this machine: transformers' `__post_init__` reads
    `self.device` (TRL's `pad_to_multiple_of="auto"` too), which would reset accelerate's state and build a
    `PartialState` here (a process group under a launcher's environment, a CUDA context on a GPU).

    The device is the target's accelerator (`cpu` with `use_cpu`), and `world_size` the launch's process count, from
    which TRL derives the GRPO/RLOO generation batch."""

    lint_accelerator = "cuda"
    lint_processes = 1
    distributed_state = None  # no accelerate state: `process_index` 0, as for one process of the launch

    @property
    def _setup_devices(self):
        import torch

        cpu = self.use_cpu or self.lint_accelerator == "cpu"
        self._n_gpu = 0 if cpu else 1
        return torch.device("cpu" if cpu else self.lint_accelerator)

    @property
    def world_size(self) -> int:
        return self.lint_processes


def config_class_for(config_class: type, num_processes: int, accelerator: str = "cuda") -> type:
    """`config_class` parsed as by each process of a launch with `num_processes` processes on `accelerator`, setting
    up no device here (see [`LintDevices`])."""
    namespace = {"lint_accelerator": accelerator, "lint_processes": num_processes}
    return type(config_class.__name__, (LintDevices, config_class), namespace)


__all__ = [
    "Launch",
    "LintDevices",
    "TARGET_FIELDS",
    "config_class_for",
    "config_file",
    "env_note",
    "explicit_fields",
    "hold_env",
    "hold_target_fields",
    "launch_from",
    "read_yaml",
    "target_problems",
    "target_values",
]
