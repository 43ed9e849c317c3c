"""The entry point of `launch/train_<kind>.py`: a user's mistake is one message and exit status 2, never a traceback.

A mistake is an [`InputError`] (a setting, the `--config` file, the model or the dataset, see `scripts.inputs`) or a
[`SafetyError`] (a configuration the safety rules refuse). Anything else is a bug and keeps its traceback. Under a
launcher (`accelerate launch`, `torchrun`, `deepspeed`), the first process of each machine prints the message and every
process exits with status 2; the launcher then reports the failed process its own way.
"""

from __future__ import annotations

import sys

from ..errors import SafetyError
from .inputs import InputError
from .preflight import is_local_main


USAGE_ERROR = 2  # argparse's status for a usage error, kept for every mistake in the input


def run(kind: str, argv: list[str] | None = None) -> None:
    """Run [`~safe_trainers.scripts.pipeline.main`] for `kind` as a program: exit 0 after training, 2 on a user's
    mistake (with its message on stderr)."""
    from .pipeline import main

    try:
        main(kind, argv)
    except (InputError, SafetyError, *upstream_mistakes()) as error:
        if is_local_main():
            print(f"{prog(kind)}: error: {error}{UPSTREAM_FIXES.get(type(error).__name__, '')}", file=sys.stderr,
                  flush=True)  # fmt: skip
        _leave_process_group()
        sys.exit(USAGE_ERROR)


# Errors of the libraries that can only come from the input (a value that cannot match this model), with the fix the
# scripts add to their message. Judged when the model is loaded, the earliest they can be.
UPSTREAM_FIXES = {
    "NoMatchingPeftModuleError": " Set `--lora_target_modules` to names of this model's layers (e.g. `q_proj v_proj` "
    "for Llama or Qwen models), or `all-linear`.",
}


def upstream_mistakes() -> tuple[type[BaseException], ...]:
    """The exception classes of `UPSTREAM_FIXES` that are installed."""
    try:
        from peft.utils.error import NoMatchingPeftModuleError
    except ImportError:
        return ()
    return (NoMatchingPeftModuleError,)


def prog(kind: str) -> str:
    return f"train_{kind}"


def _leave_process_group() -> None:
    """Destroy the process group a launcher's process may already have joined, so exiting does not warn about it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["USAGE_ERROR", "run"]
