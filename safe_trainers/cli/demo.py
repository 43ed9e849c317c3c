"""`safe-trainers demo`: show the rules and the NaN guard on a tiny local model (no network, CPU is enough)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="Train a tiny Gemma-2 with DPO from an unsafe config, inject faults, and show what safe_trainers did.",
    )
    parser.add_argument("--output-dir", "--output_dir", default=None, help="Where to write (default: a temp dir).")
    parser.add_argument("--steps", type=int, default=12, help="Optimizer steps per run.")
    parser.add_argument("--no-compare", "--no_compare", action="store_true", help="Skip the stock TRL run.")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from .demo_run import run_demo

    return run_demo(ns.output_dir, steps=ns.steps, compare=not ns.no_compare)
