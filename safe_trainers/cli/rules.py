"""`safe-trainers rules`: list every rule id with what it does."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("rules", help="List the safety rules (ids for `safety_disable_rules`).")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from ..openrlhf import RULES as OPENRLHF_RULES
    from ..rules import DEFAULT_RULES

    sections = [("Trainer rules (safety_disable_rules / --safety_disable_rules)", DEFAULT_RULES)]
    sections.append(("OpenRLHF shim rules (safe-trainers openrlhf --safety-disable-rules)", OPENRLHF_RULES))
    for title, rules in sections:
        print(title)
        width = max(len(r.id) for r in rules)
        for rule in rules:
            kinds = ",".join(sorted(rule.trainers))
            print(f"  {rule.id:<{width}}  [{kinds}]  {rule.summary}")
    return 0
