"""The command line of the launch scripts and `safe-trainers check` as TRL's parser reads it: a negative number after
a space as the value, `--config=x` as `--config x`, and the `--config` path (pure functions; the `"argv"` stage of
[`~safe_trainers.scripts.inputs`])."""

from __future__ import annotations

from collections.abc import Sequence


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """`--name -1e-5` as `--name=-1e-5`, so that a negative number after a space is read as the value, not as a flag
    (argparse takes `-1e-5` for an option). Pure."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _is_negative_number(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _is_negative_number(text: str) -> bool:
    if not text.startswith("-") or text.startswith("--"):
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """`argv` as TRL's parser reads it: `--config=x` as `--config x`, and [`join_negative_values`]. Pure."""
    split = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
    return join_negative_values(split)


def config_path(argv: Sequence[str]) -> str | None:
    """The `--config` path in `argv` (`--config x` or `--config=x`), or `None`. Pure."""
    for i, arg in enumerate(argv):
        if arg == "--config":
            return argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


__all__ = ["config_path", "join_negative_values", "normalize_argv"]
