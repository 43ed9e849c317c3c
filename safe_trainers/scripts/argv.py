"""The command line of the launch scripts and `safe-trainers check` as TRL's parser reads it: a negative number after
a space as the value, `--config=x` as `--config x`, the `--config` path and other flag values, and what a
`--resume_from_checkpoint` string means (pure functions; the `"argv"` stage of [`~safe_trainers.scripts.inputs`])."""

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


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of the last `--<name> x` or `--<name>=x` in `argv` (argparse keeps the last), or `None`. Pure."""
    found = None
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(f"--{name}="):
            found = arg.split("=", 1)[1]
    return found


RESUME_LATEST = frozenset({"true", "yes", "1"})  # `--resume_from_checkpoint true`: the newest checkpoint there
RESUME_NONE = frozenset({"", "false", "no", "0", "none"})


def resume_target(value: str | bool | None) -> str | bool | None:
    """What `resume_from_checkpoint` asks `train()` for: `True` (the newest checkpoint in `output_dir`) for `true`,
    `None` for `false`, else the checkpoint path. The command line and a YAML file give a string, which transformers
    would take for a path (`true` included). Pure."""
    if not isinstance(value, str):
        return value or None
    key = value.strip().lower()
    return True if key in RESUME_LATEST else None if key in RESUME_NONE else value


__all__ = ["config_path", "flag_value", "join_negative_values", "normalize_argv", "resume_target"]
