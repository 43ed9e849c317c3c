"""`safe-trainers check`: placeholder."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("check", help="Print the safety report for a config without training.")
    parser.set_defaults(run=lambda ns: 2)
