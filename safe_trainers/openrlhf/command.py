"""Parse an OpenRLHF launcher command into launcher, entry point and flag items; read it for the rules; rewrite it.

Only the tokens after the entry point are read as OpenRLHF flags, the way its argparse parser reads them: a token
starting with `-` (not a negative number, no space before any `=`) starts an option, `--flag=value` is one token, and
every following non-option token is one of its values. Nothing is normalised: rewriting replaces, drops or appends
tokens and leaves every other token as written, in order.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..redact import mask_secret
from ..redact import shown as shown_value
from ..rules.report import REMOVED, Change
from .flags import Generation, flag_kind, flags_for, known_flags, resolve
from .models import ModelInfo


class CommandError(ValueError):
    """The command cannot be read safely (no OpenRLHF entry point, a rule flag without a usable value, ...)."""


_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_MODULE = re.compile(r"^openrlhf\.cli\.(\w+)$")
# Before 0.3.6 every step was a script of `examples/` (`deepspeed ../train_rm.py`, `python ../batch_inference.py`).
_SCRIPT = re.compile(r"^(train_\w+|batch_inference|interactive_chat)\.py$")


def is_option(token: str) -> bool:
    """Whether argparse reads `token` as an option rather than a value."""
    if len(token) < 2 or token[0] != "-" or _NEGATIVE_NUMBER.match(token):
        return False
    return " " not in token.split("=", 1)[0]


@dataclass(frozen=True)
class Item:
    """One option with its values (or a stray token), exactly as written.

    Args:
        name (`str | None`): the option as written, without `=value` (`None` for a stray value or the `--` tail).
        values (`tuple[str, ...]`): its values (`("x",)` for `--flag=x`).
        tokens (`tuple[str, ...]`): the original tokens.
        inline (`bool`): written as `--flag=value`.
    """

    name: str | None
    values: tuple[str, ...]
    tokens: tuple[str, ...]
    inline: bool = False


def split_items(tokens: Sequence[str]) -> tuple[Item, ...]:
    items: list[Item] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":  # argparse's end of options: keep the rest as one opaque item
            items.append(Item(None, (), tuple(tokens[i:])))
            break
        if not is_option(token):
            items.append(Item(None, (token,), (token,)))
            i += 1
        elif token.startswith("--") and "=" in token:
            name, value = token.split("=", 1)
            items.append(Item(name, (value,), (token,), inline=True))
            i += 1
        else:
            j = i + 1
            while j < len(tokens) and tokens[j] != "--" and not is_option(tokens[j]):
                j += 1
            items.append(Item(token, tuple(tokens[i + 1 : j]), tuple(tokens[i:j])))
            i = j
    return tuple(items)


@dataclass(frozen=True)
class OpenRLHFCommand:
    """A parsed launcher command.

    Args:
        launcher (`tuple[str, ...]`): every token up to and including the entry point (`deepspeed --num_gpus 8
            --module openrlhf.cli.train_rm`, `python -m openrlhf.cli.train_ppo_ray`, `deepspeed ../train_kto.py`).
        entry (`str`): the trainer, e.g. `"train_rm"`.
        items (`tuple[Item, ...]`): the trainer's options, in order.
    """

    launcher: tuple[str, ...]
    entry: str
    items: tuple[Item, ...] = field(default=())

    @property
    def argv(self) -> list[str]:
        return [*self.launcher, *(token for item in self.items for token in item.tokens)]

    def option_names(self) -> list[str]:
        return [item.name for item in self.items if item.name is not None and item.name.startswith("--")]

    @property
    def examples_script(self) -> bool:
        """Whether the entry point is an `examples/*.py` script of OpenRLHF <= 0.3.5 (not an `openrlhf/cli` file)."""
        entry = self.launcher[-1].replace(os.sep, "/")
        return entry.endswith(".py") and "openrlhf/cli/" not in entry


def parse_command(argv: Sequence[str]) -> OpenRLHFCommand:
    """Split `argv` at its OpenRLHF entry point: `openrlhf.cli.<x>` (after `--module`/`-m`; a trainer, `serve_rm`,
    `batch_inference`, or any other) or a script of releases before 0.3.6 (`train_<x>.py`, `batch_inference.py`,
    `interactive_chat.py`). Whether rules apply to the entry point is the caller's decision (see `ENTRY_POINTS`).

    Raises:
        `CommandError`: `argv` is empty or names no OpenRLHF trainer.
    """
    argv = [str(token) for token in argv]
    if not argv:
        raise CommandError("no command given: put the OpenRLHF launcher command after `--`.")
    for index, token in enumerate(argv):
        module = _MODULE.match(token)
        script = _SCRIPT.match(os.path.basename(token)) if token.endswith(".py") else None
        if module is None and script is None:
            continue
        entry = module.group(1) if module else script.group(1)
        return OpenRLHFCommand(tuple(argv[: index + 1]), entry, split_items(argv[index + 1 :]))
    named = next((argv[i + 1] for i, t in enumerate(argv[:-1]) if t in ("-m", "--module")), argv[0])
    raise CommandError(
        f"no OpenRLHF entry point in the command (`{named}` is not one): expected `deepspeed --module "
        "openrlhf.cli.train_<x> ...`, `python -m openrlhf.cli.train_ppo_ray ...`, or a script of OpenRLHF <= 0.3.5 "
        "(`deepspeed path/to/train_<x>.py ...`, `python path/to/batch_inference.py ...`)."
    )


def _bad_value(flag: str, item: Item, why: str) -> CommandError:
    written = f"`{item.name}`" if item.name == flag else f"`{item.name}` (read as `{flag}`)"
    return CommandError(f"{written} {why}. Fix the command; nothing was run.")


@dataclass(frozen=True)
class CommandView:
    """A read-only view of a command under one flag generation, for the rules.

    Args:
        command (`OpenRLHFCommand`): the parsed command.
        generation (`Generation`): whose flag names to read.
        models (`tuple[ModelInfo, ...]`): the models the command names.
        bf16_supported (`bool | None`): whether the GPUs support bf16 (`None`: unknown, assumed yes).
    """

    command: OpenRLHFCommand
    generation: Generation
    models: tuple[ModelInfo, ...] = ()
    bf16_supported: bool | None = None

    @property
    def entry(self) -> str:
        return self.command.entry

    def flags(self, concern: str) -> tuple[str, ...]:
        return flags_for(concern, self.generation, self.entry)

    def flag(self, concern: str) -> str | None:
        found = self.flags(concern)
        return found[0] if found else None

    def occurrences(self, flag: str) -> list[Item]:
        generation, entry = self.generation, self.entry
        return [item for item in self.command.items if item.name and resolve(item.name, generation, entry) == flag]

    def has(self, flag: str | None) -> bool:
        return flag is not None and bool(self.occurrences(flag))

    def value(self, flag: str | None) -> str | None:
        """The value argparse would keep for `flag` (its last occurrence), `None` when absent or a switch."""
        found = self.occurrences(flag) if flag else []
        if not found or flag_kind(flag) == "bool":
            return None
        item = found[-1]
        if not item.values:
            raise _bad_value(flag, item, "needs a value but has none")
        return item.values[0]

    def number(self, flag: str | None, default: float) -> float:
        raw = self.value(flag)
        if raw is None:
            return default
        try:
            value = int(raw) if flag_kind(flag) == "int" else float(raw)
        except ValueError:
            kind = "an integer" if flag_kind(flag) == "int" else "a number"
            raise _bad_value(flag, self.occurrences(flag)[-1], f"needs {kind}, got {shown_value(flag, raw)}") from None
        return value

    def validate(self) -> None:
        """Raise a `CommandError` for any rule flag without a usable value (the first such token is named)."""
        for flag in known_flags(self.generation, self.entry):
            kind = flag_kind(flag)
            if kind in ("int", "float"):
                self.number(flag, 0.0)
            elif kind == "str":
                self.value(flag)


def shown(view: CommandView, flag: str) -> str:
    """`--flag value` as the rule read it (`--flag` for a switch)."""
    value = view.value(flag)
    return f"`{flag}`" if value is None else f"`{flag} {mask_secret(flag, value)}`"


def model_paths(view: CommandView) -> list[tuple[str, str]]:
    """`(flag, path)` for every model the command names (comma-separated lists split)."""
    pairs = []
    for flag in view.flags("model"):
        raw = view.value(flag)
        pairs.extend((flag, p.strip()) for p in (raw or "").split(",") if p.strip())
    return pairs


def apply_changes(command: OpenRLHFCommand, changes: Iterable[Change], generation: Generation) -> OpenRLHFCommand:
    """A new command with `changes` (paths `"argv.<flag>"`) applied: `new=REMOVED` drops every occurrence,
    `old=REMOVED` appends the flag, otherwise the last occurrence's value is replaced in place, spelling kept."""
    items = list(command.items)
    for change in changes:
        flag = change.path.removeprefix("argv.")
        kind = flag_kind(flag)
        hits = [i for i, it in enumerate(items) if it.name and resolve(it.name, generation, command.entry) == flag]
        if change.new is REMOVED:
            for i in reversed(hits):
                item = items[i]
                rest = () if item.inline else item.values if kind == "bool" else item.values[1:]
                items[i : i + 1] = [Item(None, (v,), (v,)) for v in rest]
        elif change.old is REMOVED or not hits:
            tail = next((i for i, it in enumerate(items) if it.tokens[:1] == ("--",) and it.name is None), len(items))
            added = (flag,) if kind == "bool" else (flag, str(change.new))
            items.insert(tail, Item(flag, added[1:], added))
        else:
            item = items[hits[-1]]
            new = str(change.new)
            if item.inline:
                items[hits[-1]] = Item(item.name, (new,), (f"{item.name}={new}",), inline=True)
            else:
                values = (new, *item.values[1:])
                items[hits[-1]] = Item(item.name, values, (item.name, *values))
    return OpenRLHFCommand(command.launcher, command.entry, tuple(items))


__all__ = [
    "CommandError",
    "CommandView",
    "Item",
    "OpenRLHFCommand",
    "apply_changes",
    "is_option",
    "model_paths",
    "parse_command",
    "shown",
    "split_items",
]
