"""Values that are credentials are never repeated: every message and report that shows a setting's value shows it
through [`mask_secret`].

A setting is a credential when its name says so ([`looks_like_secret`]: `hub_token`, `HF_TOKEN`, `wandb_api_key`,
`password`, ..., misspelt ones too) or when its value has the shape of a known token (`hf_...`, `sk-...`, `ghp_...`),
whatever it is called. A tokenizer's special token (`pad_token`, `eos_token`) and a count of tokens (`max_tokens`) are
not credentials. Pure functions.
"""

from __future__ import annotations

import re
from typing import Any


class _Hidden:
    """What a credential's value is shown as: `<hidden>` (in text, in `repr` and in JSON reports)."""

    def __repr__(self) -> str:
        return "<hidden>"

    __str__ = __repr__


HIDDEN: Any = _Hidden()

# The last word of a credential's name (`hub_token`, `WANDB_API_KEY`, `db_password`, `hfToken`).
SECRET_WORDS = frozenset({
    "token", "key", "secret", "secrets", "password", "passwd", "passphrase", "pwd", "auth", "credential",
    "credentials", "creds", "cookie", "apikey",
})  # fmt: skip
# Words a misspelling is compared with (one letter added, dropped, changed or swapped): long enough to tell apart.
SPELLED_WORDS = frozenset(word for word in SECRET_WORDS if len(word) >= 5)
# Last words one edit away from a credential word that are words of their own (`max_tokens` counts tokens).
NOT_SECRET_WORDS = frozenset({"tokens", "taken", "woken"})
# A word before `token` that makes it one of a tokenizer's special tokens (`pad_token`), not a credential.
SPECIAL_TOKEN_ROLES = frozenset({
    "pad", "eos", "bos", "unk", "sep", "cls", "mask", "start", "end", "image", "video", "audio", "boi", "eoi", "think",
    "special", "added", "sentinel", "vision", "placeholder",
})  # fmt: skip
# A word before `key` that makes it the name of a field or a lookup (`sort_key`), not a credential.
DATA_KEY_ROLES = frozenset({
    "sort", "cache", "dict", "hash", "lookup", "column", "field", "label", "prompt", "text", "group", "primary",
    "foreign", "index", "map", "metric", "dataset", "data", "row", "message", "role", "content", "reward", "feature",
})  # fmt: skip
# Values that are credentials by their shape alone (Hugging Face, OpenAI/Anthropic, GitHub, Slack, AWS access keys).
TOKEN_SHAPES = re.compile(
    r"(hf_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}"
    r"|xox[abprs]-[A-Za-z0-9\-]{10,}|AKIA[0-9A-Z]{16})"
)

# The password of a URL's user info (`https://user:password@host/...`): hidden, the rest of the URL shown.
URL_PASSWORD = re.compile(r"(:/{1,2}[^/\s:@]*:)[^/\s@]+(@)")  # `:/` too: the URL as a path
# A known token's shape inside a longer text (an upstream error that quotes the value it received).
TOKEN_IN_TEXT = re.compile(rf"(?<![A-Za-z0-9_\-])(?:{TOKEN_SHAPES.pattern})(?![A-Za-z0-9_\-])")


def name_words(name: str) -> list[str]:
    """The words of a setting's or a variable's name, lowercased: `--hub-token` and `hfToken` as `["hub", "token"]`,
    `["hf", "token"]`. Pure."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", str(name))
    return [word.lower() for word in re.split(r"[^A-Za-z0-9]+", spaced) if word]


def _one_edit(word: str, target: str) -> bool:
    """Whether `word` is `target` with one letter added, dropped or changed, or two neighbours swapped. Pure."""
    if len(word) == len(target):
        diff = [i for i, (a, b) in enumerate(zip(word, target)) if a != b]
        swap = len(diff) == 2 and diff[1] == diff[0] + 1 and word[diff[0]] == target[diff[1]]
        return len(diff) == 1 or (swap and word[diff[1]] == target[diff[0]])
    short, long = sorted((word, target), key=len)
    return len(long) - len(short) == 1 and any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def _secret_word(word: str) -> bool:
    if word in SECRET_WORDS:
        return True
    if word in NOT_SECRET_WORDS:
        return False
    return any(_one_edit(word, target) for target in SPELLED_WORDS)


def looks_like_secret(name: str) -> bool:
    """Whether a setting named `name` holds a credential: its last word is `token`, `key`, `secret`, `password`,
    `auth`, ... (or one of them misspelt), unless `token` is a tokenizer's special token (`pad_token`) or `key` names a
    field (`sort_key`). `max_tokens`, `tokenizer`, `token_level_kl` and `keyword` are not credentials. Pure."""
    words = name_words(name)
    if not words or not _secret_word(words[-1]):
        return False
    before = words[-2] if len(words) > 1 else None
    if words[-1] == "token" and before in SPECIAL_TOKEN_ROLES:
        return False
    return not (words[-1] == "key" and before in DATA_KEY_ROLES)


def looks_like_token(value: Any) -> bool:
    """Whether `value` is a string with the shape of a known access token (`hf_...`, `sk-...`, `ghp_...`). Pure."""
    return isinstance(value, str) and TOKEN_SHAPES.fullmatch(value.strip()) is not None


def mask_secret(name: str, value: Any) -> Any:
    """`value` as a message or a report may show it for the setting `name`: [`HIDDEN`] for a credential (see
    [`looks_like_secret`] and [`looks_like_token`]; `None`, a bool and an empty string are shown, they hold none), a
    mapping with its credentials' values hidden, a URL with its password hidden, `value` itself otherwise. Pure.

    Args:
        name (`str`): the setting's name as written (`hub_token`, `--hub-token`, `args.hub_token`, `HF_TOKEN`).
        value (`Any`): its value.
    """
    if value is None or isinstance(value, bool) or value == "":
        return value
    if isinstance(value, dict):
        return {key: mask_secret(str(key), item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_secret(name, item) for item in value)
    if looks_like_secret(name.rsplit(".", 1)[-1]) or looks_like_token(value):
        return HIDDEN
    return URL_PASSWORD.sub(rf"\1{HIDDEN}\2", value) if isinstance(value, str) else value


def hide_in_text(text: str) -> str:
    """`text` (a message of TRL's, transformers' or argparse's that quotes the values it received) with known tokens'
    values and URLs' passwords shown as `<hidden>`. Pure."""
    return URL_PASSWORD.sub(rf"\1{HIDDEN}\2", TOKEN_IN_TEXT.sub(str(HIDDEN), text))


def shown(name: str, value: Any) -> str:
    """`repr` of `value` for the setting `name`, as the messages write it, with credentials hidden. Pure."""
    return repr(mask_secret(name, value))


__all__ = ["HIDDEN", "hide_in_text", "looks_like_secret", "looks_like_token", "mask_secret", "name_words", "shown"]
