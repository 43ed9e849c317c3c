"""Built-in GRPO reward functions, selectable by name from the launch scripts (`--reward_funcs count_words length`).

Every function follows TRL's reward-function signature: it receives the completions (strings, or lists of chat
messages for conversational data) plus the dataset columns as keyword arguments, and returns one float per completion.
Any other function is selected with a `module:function` path (e.g. `--reward_funcs my_rewards:exact_match`).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from .toy import count_words_reward


RewardFunc = Callable[..., list[float]]

DEFAULT_MAX_WORDS = 64
DEFAULT_FORMAT_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


def completion_text(completion: Any) -> str:
    """The text of one completion: the string itself, or the joined `content` of a list of chat messages."""
    if isinstance(completion, str):
        return completion
    return " ".join(str(message.get("content", "")) for message in completion)


def count_words(completions: list, **kwargs: Any) -> list[float]:
    """+1 per "good"/"yes" word and -1 per "bad"/"no" word: the toy reward, learnable by the tiny local models."""
    return count_words_reward(completions, **kwargs)


def length(completions: list, max_words: int = DEFAULT_MAX_WORDS, **kwargs: Any) -> list[float]:
    """0 for a completion of at most `max_words` words, then a penalty growing linearly to -1 at twice that length."""
    rewards = []
    for completion in completions:
        excess = len(completion_text(completion).split()) - max_words
        rewards.append(-min(1.0, excess / max_words) if excess > 0 else 0.0)
    return rewards


def make_format_reward(pattern: str = DEFAULT_FORMAT_PATTERN, name: str = "format") -> RewardFunc:
    """A reward of 1.0 for completions matching the regular expression `pattern` (searched, dot matches newline),
    0.0 otherwise."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: list, **kwargs: Any) -> list[float]:
        return [1.0 if compiled.search(completion_text(c)) else 0.0 for c in completions]

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"1.0 when the completion matches `{pattern}`, else 0.0."
    return reward


format = make_format_reward()  # noqa: A001 - the reward's public name, as selected by `--reward_funcs format`
"""1.0 when the completion is `<think>...</think> <answer>...</answer>`, else 0.0."""

BUILTIN_REWARDS: dict[str, RewardFunc] = {"count_words": count_words, "length": length, "format": format}


def load_reward_func(name: str) -> RewardFunc:
    """The reward function selected by `name`: a built-in name (see `BUILTIN_REWARDS`) or a `module:function` path.

    A dotted `module.function` path is accepted too, as TRL's scripts do. The current directory is searched after the
    usual import path, so a `my_rewards.py` next to where the job is launched is found.

    Raises:
        ValueError: for an unknown name, a module that cannot be imported, or a missing or non-callable attribute.
    """
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" in name:
        module_name, _, attribute = name.partition(":")
    elif "." in name:
        module_name, _, attribute = name.rpartition(".")
    else:
        raise ValueError(
            f"Unknown reward function {name!r} in `reward_funcs`. Use a built-in name ({', '.join(BUILTIN_REWARDS)}) "
            "or a `module:function` path to your own function, e.g. `--reward_funcs my_rewards:exact_match`."
        )
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"Could not import module `{module_name}` for the reward function {name!r} in `reward_funcs`: {error}. "
            "Make sure the module is on `PYTHONPATH` (or in the current directory)."
        ) from error
    func = getattr(module, attribute, None)
    if not callable(func):
        raise ValueError(
            f"Module `{module_name}` has no callable `{attribute}` (from {name!r} in `reward_funcs`). Define "
            f"`def {attribute}(completions, **kwargs) -> list[float]` in it."
        )
    return func


def load_reward_funcs(names: list[str]) -> list[RewardFunc | str]:
    """The reward functions for `names`, in order. A name that is an existing local directory is passed through as
    a reward-model path (GRPO scores with it)."""
    if not names:
        raise ValueError(
            "`reward_funcs` is empty: GRPO needs at least one reward. Use a built-in name "
            f"({', '.join(BUILTIN_REWARDS)}) or a `module:function` path."
        )
    return [name if os.path.isdir(name) else load_reward_func(name) for name in names]


__all__ = [
    "BUILTIN_REWARDS",
    "completion_text",
    "count_words",
    "format",
    "length",
    "load_reward_func",
    "load_reward_funcs",
    "make_format_reward",
]
