"""Safety rules for OpenRLHF launcher commands (`safe-trainers openrlhf -- deepspeed --module openrlhf.cli.train_rm`).

Reads the command, finds the OpenRLHF trainer and its models, applies the rules in the flag names of the OpenRLHF
release in use, and returns the rewritten argument list with a [`SafetyReport`]. See `shim.sanitize` and `shim.run`.
"""

from .command import CommandError, OpenRLHFCommand, parse_command
from .flags import Generation, generation_for_version
from .rules import RULES, rule_ids
from .shim import plan, run, sanitize


__all__ = [
    "RULES",
    "CommandError",
    "Generation",
    "OpenRLHFCommand",
    "generation_for_version",
    "parse_command",
    "plan",
    "rule_ids",
    "run",
    "sanitize",
]
