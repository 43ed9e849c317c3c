"""Which OpenRLHF flag generation a command is written for, told by its own flags.

OpenRLHF renamed flags between releases (see `flags.py`), so a command's own flags say which releases accept it: a
dotted flag exists only in `DOTTED`; a flat flag that `DOTTED` no longer has, a script of `examples/`, and each of
`--param_dtype`, `--flash_attn`, `--vanilla_loss`, `--attn_implementation` and `--bf16` allow only some generations.
[`detect_generations`] keeps the generations every telling flag allows; a command whose flags leave none fits no
single release and is refused.
"""

from __future__ import annotations

from .command import CommandError, OpenRLHFCommand
from .flags import ATTN_IMPL, DOTTED, GENERATIONS, LEGACY, PARAM_DTYPE, Generation, fits_dotted, resolve


def detect_generations(command: OpenRLHFCommand) -> tuple[tuple[Generation, ...], str]:
    """The flag generations the command's own flags fit, newest first, and the flags that told.

    Raises:
        `CommandError`: the command mixes flags that no single OpenRLHF release accepts.
    """
    names = command.option_names()
    dotted = [n for n in names if "." in n]
    if dotted:
        return (DOTTED,), f"`{dotted[0]}`"
    markers: list[tuple[str, set[Generation]]] = []
    flat = next((n for n in names if not fits_dotted(n)), None)  # a flat flag that >= 0.10.2 no longer has
    if flat is not None:
        markers.append((flat, {LEGACY, ATTN_IMPL, PARAM_DTYPE}))
    if command.examples_script:  # the `examples/` scripts were replaced by `openrlhf.cli` modules in 0.3.6
        markers.append((command.launcher[-1], {LEGACY}))
    checks = (
        ("--param_dtype", (PARAM_DTYPE,), {PARAM_DTYPE}),
        ("--flash_attn", (LEGACY,), {LEGACY}),
        ("--vanilla_loss", (LEGACY,), {LEGACY}),
        ("--attn_implementation", (ATTN_IMPL, PARAM_DTYPE), {ATTN_IMPL, PARAM_DTYPE}),
        ("--bf16", (LEGACY, ATTN_IMPL), {LEGACY, ATTN_IMPL}),
    )
    for flag, tables, allowed in checks:
        hit = next((n for n in names for g in tables if resolve(n, g, command.entry) == flag), None)
        if hit is not None:
            markers.append((hit, allowed))
    candidates = set(GENERATIONS)
    for name, allowed in markers:
        if not candidates & allowed:
            told = ", ".join(f"`{n}` ({' or '.join(sorted(str(g) for g in a))})" for n, a in markers)
            raise CommandError(
                f"`{name}` does not fit the other flags: no OpenRLHF release accepts all of {told}. Fix the command, "
                "or pass `--openrlhf-version` to choose the release whose flag names the rules use."
            )
        candidates &= allowed
    ordered = tuple(g for g in GENERATIONS if g in candidates)
    telling = ", ".join(f"`{name}`" for name, _ in markers[1 if flat is not None else 0 :])
    reason = telling or (f"undotted flags such as `{flat}`" if flat else "no version-specific flag")
    return ordered, reason


__all__ = ["detect_generations"]
