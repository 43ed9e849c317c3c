"""`safe-trainers demo`: placeholder."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="Train a tiny DPO model with an unsafe config and show the report.")
    parser.set_defaults(run=lambda ns: 2)
