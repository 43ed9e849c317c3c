"""`safe-trainers openrlhf`: placeholder, replaced by the shim."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("openrlhf", help="Sanitize an OpenRLHF launcher command, then run it.")
    parser.set_defaults(run=lambda ns: 2)
