"""`safe-trainers openrlhf [options] -- <launcher command>`: sanitize an OpenRLHF launcher command, then run it."""

from __future__ import annotations

import argparse


EPILOG = """\
example:
  safe-trainers openrlhf -- deepspeed --module openrlhf.cli.train_rm \\
      --pretrain google/gemma-2-2b-it --bf16 --flash_attn --max_norm 0

Everything after `--` is the launcher command, run as an argument list (no shell) once the rules have rewritten it.
The report goes to stderr; with `--dry-run` the rewritten command goes to stdout, quoted for a POSIX shell.
Exit code: the command's own; 1 when a rule blocks it; 2 when it cannot be read."""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "openrlhf",
        help="Sanitize an OpenRLHF launcher command, then run it.",
        description="Apply the safety rules to an OpenRLHF launcher command (deepspeed/torchrun/python -m), print "
        "the report, and run the rewritten command.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dry-run", "--dry_run", dest="dry_run", action="store_true", help="Print the rewritten command, run nothing."
    )
    parser.add_argument(
        "--openrlhf-version",
        "--openrlhf_version",
        dest="openrlhf_version",
        default=None,
        metavar="V",
        help="OpenRLHF release whose flag names to use when openrlhf is not installed here (e.g. 0.8.9, 0.11.2). "
        "Without it they are recognised from the command's flags.",
    )
    parser.add_argument(
        "--safety-mode",
        "--safety_mode",
        dest="safety_mode",
        default="fix",
        choices=["fix", "warn", "strict", "off"],
        help="`fix` (default) rewrites and reports; `warn` reports and runs the command unchanged; `strict` refuses "
        "any finding (exit 1); `off` runs the command unchanged. Blocked findings refuse in every mode but `off`.",
    )
    parser.add_argument(
        "--safety-disable-rules",
        "--safety_disable_rules",
        dest="safety_disable_rules",
        nargs="+",
        action="extend",
        default=[],
        metavar="ID",
        help="Rule ids to skip, e.g. `attention.gemma2_no_flash` (space- or comma-separated).",
    )
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from ..openrlhf import shim

    disabled = [rule for value in ns.safety_disable_rules for rule in value.replace(",", " ").split()]
    return shim.run(
        list(getattr(ns, "passthrough", []) or []),
        version=ns.openrlhf_version,
        mode=ns.safety_mode,
        disabled=disabled,
        dry_run=ns.dry_run,
    )
