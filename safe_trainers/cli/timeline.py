"""`safe-trainers timeline OUTPUT_DIR`: a run's health at a glance (`safe_trainers/timeline/`). Prints the text
summary and writes `timeline.png` and `timeline.html` (or `--out PREFIX`.png/.html); without matplotlib, the summary
and how to install it. Works on a finished, a crashed and a running run: it only reads."""

from __future__ import annotations

import argparse
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "timeline",
        help="Draw a run's metrics, guard events and restarts from its output_dir (PNG and HTML), with its goodput.",
    )
    parser.add_argument("output_dir", help="The run's `output_dir`.")
    parser.add_argument(
        "--out", default=None,
        help="Where to write the picture: PREFIX.png and PREFIX.html (default: OUTPUT_DIR/timeline).",
    )  # fmt: skip
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from ..timeline import read_run, summary
    from ..timeline.picture import INSTALL_HINT, plotting_available, save_html, save_png

    try:
        found = read_run(ns.output_dir)
    except (FileNotFoundError, ValueError) as error:
        print(f"safe-trainers timeline: {error}", file=sys.stderr)
        return 2
    text = summary(found)
    print(text)
    if not plotting_available():
        print(f"\nNo picture drawn: {INSTALL_HINT}.", file=sys.stderr)
        return 0
    prefix = ns.out or os.path.join(ns.output_dir, "timeline")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    save_png(found, f"{prefix}.png")
    save_html(found, f"{prefix}.html", text)
    print(f"\nwrote {prefix}.png and {prefix}.html")
    return 0
