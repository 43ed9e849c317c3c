"""`safe-trainers`: `check` a config, list the `rules`, run the `demo`, draw a run's `timeline`, `replay` a faulted
step, or sanitize an `openrlhf` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from . import check, demo, openrlhf, replay, rules, timeline

    parser = argparse.ArgumentParser(
        prog="safe-trainers",
        description="Safety rules and NaN guard for TRL trainers. See `safe-trainers <command> --help`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (check, rules, demo, timeline, replay, openrlhf):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `openrlhf` forwards everything after `--` untouched, so argparse must not see it.
    tail: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1 :]
    ns, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(ns, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    # `check` takes config overrides (`--fp16 true`) with or without a `--` before them.
    ns.passthrough = unknown + tail
    return int(ns.run(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
