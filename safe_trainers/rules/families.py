"""Model families recognised from a Hub id or a path's name, for when no `config.json` can be read.

One table for the OpenRLHF shim (which never imports transformers), `safe-trainers check` and the trainers: a Hub id
linted offline ("google/gemma-2-9b-it") still gets the rules of its family, and the report says the family was
inferred from the name. A name that matches no pattern stays unknown: no rule guesses.
"""

from __future__ import annotations

import re


# (pattern on one path component, model_type), first match wins. Lookaheads keep Gemma-1 "gemma-2b" out of Gemma-2.
NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"gemma[-_ ]?4", "gemma4"),
    (r"gemma[-_ ]?3n", "gemma3n"),
    (r"gemma[-_ ]?3(?![\d.]*b)", "gemma3"),
    (r"gemma[-_ ]?2(?![\d.]*b)", "gemma2"),
    (r"gemma", "gemma"),
    (r"qwen[-_ ]?3[._]5", "qwen3_5"),
    (r"qwen[-_ ]?3.*-a\d+(\.\d+)?b", "qwen3_moe"),
    (r"qwen[-_ ]?3", "qwen3"),
    (r"qwen[-_ ]?2[._]5[-_ ]?vl", "qwen2_5_vl"),
    (r"qwen[-_ ]?2[-_ ]?vl", "qwen2_vl"),
    (r"qwen[-_ ]?(2|1[._]5).*(moe|-a\d+(\.\d+)?b)", "qwen2_moe"),
    (r"qwen[-_ ]?(2|1[._]5)|qwq|distill-qwen", "qwen2"),
    (r"gpt[-_]?oss", "gpt_oss"),
    (r"mixtral", "mixtral"),
    (r"mistral", "mistral"),
    (r"llama", "llama"),
)


def family_from_name(name: str) -> str | None:
    """The `model_type` a Hub id or path most likely has, from its last recognisable path component (pure).

    Example:
        ```python
        >>> family_from_name("google/gemma-2-9b-it"), family_from_name("google/gemma-2b"), family_from_name("my/model")
        ('gemma2', 'gemma', None)
        ```
    """
    for part in reversed([p for p in re.split(r"[\\/]", name.lower()) if p]):
        for pattern, model_type in NAME_PATTERNS:
            if re.search(pattern, part):
                return model_type
    return None


__all__ = ["NAME_PATTERNS", "family_from_name"]
