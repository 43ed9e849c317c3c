"""`safe-trainers rules`: list every rule id with what it does."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("rules", help="List the safety rules (ids for `safety_disable_rules`).")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from ..rules import DEFAULT_RULES

    width = max(len(r.id) for r in DEFAULT_RULES)
    for rule in DEFAULT_RULES:
        kinds = ",".join(sorted(rule.trainers))
        print(f"{rule.id:<{width}}  [{kinds}]  {rule.summary}")
    return 0
