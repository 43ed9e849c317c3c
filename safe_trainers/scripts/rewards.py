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

from ..testing.toy import count_words_reward
from . import places
from .inputs import InputError


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

# TRL's reward functions under the names TRL's own GRPO/RLOO scripts take (`trl/scripts/grpo.py`), with the arguments
# those scripts give a factory: `(attribute of trl.rewards, factory keyword arguments or None)`.
TRL_REWARDS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "accuracy_reward": ("accuracy_reward", None),
    "reasoning_accuracy_reward": ("reasoning_accuracy_reward", None),
    "think_format_reward": ("think_format_reward", None),
    "get_soft_overlong_punishment": (
        "get_soft_overlong_punishment", {"max_completion_len": 1280, "soft_punish_cache": 256}
    ),
}  # fmt: skip


# The reward names of open-r1's GRPO script (`open_r1.rewards.get_reward_funcs`) that the launch scripts do not build,
# with the function each names in `open_r1.rewards` and whether it is used as is (`True`) or built by open-r1's script
# from its own settings (`False`: `code_language`, `parallel_code_exec_per_proc`, `cosine_max_len`, ...). open-r1's
# `format` and `length` are not here: those names select this module's own `format` and `length`.
OPEN_R1_REWARDS: dict[str, tuple[str, bool]] = {
    "accuracy": ("accuracy_reward", True),
    "reasoning_steps": ("reasoning_steps_reward", True),
    "tag_count": ("tag_count_reward", True),
    "cosine": ("get_cosine_scaled_reward", False),
    "repetition_penalty": ("get_repetition_penalty_reward", False),
    "code": ("code_reward", False),
    "binary_code": ("binary_code_reward", False),
    "ioi_code": ("ioi_code_reward", False),
    "cf_code": ("cf_code_reward", False),
    "code_format": ("get_code_format_reward", False),
    "soft_overlong_punishment": ("get_soft_overlong_punishment", False),
}


def reward_name_problem(name: str) -> str | None:
    """Why `name` cannot select a reward function, or `None`: judged from its form, and for a directory (a reward
    model) from its files, with nothing imported or loaded. Shared by the launch scripts (which refuse the name) and
    `safe-trainers check` (which warns: a script of the user's own may resolve it), so that a config `check` passes
    without a warning is one the scripts run."""
    if os.path.isdir(name):
        lacks = places.observe(name, "model", online=False).model_lacks
        if lacks is None:
            return None
        return (f"`reward_funcs` names the directory {name!r} as a reward model, but it is a directory without "
                f"{lacks}. Point it at a reward model saved with `save_pretrained`.")  # fmt: skip
    if name in BUILTIN_REWARDS or name in TRL_REWARDS or ":" in name or "." in name:
        return None
    message = (
        f"Unknown reward function {name!r} in `reward_funcs`. Use a built-in name ({', '.join(BUILTIN_REWARDS)}), one "
        f"of TRL's ({', '.join(TRL_REWARDS)}), or a `module:function` path to your own function, e.g. "
        "`--reward_funcs my_rewards:exact_match`."
    )
    return message if name not in OPEN_R1_REWARDS else f"{message} {open_r1_hint(name)}"


def open_r1_hint(name: str) -> str:
    """What `name`, a reward name of open-r1's GRPO script, is there, and how to run it with these scripts."""
    function, plain = OPEN_R1_REWARDS[name]
    where = f"`{name}` is the name open-r1's `grpo.py` gives `open_r1.rewards.{function}`"
    if plain:
        return f"{where}: with open-r1 installed, select it by path, `--reward_funcs open_r1.rewards:{function}`."
    return (
        f"{where}, which that script builds from its own settings: run the recipe with open-r1's script, or build the "
        "reward in a function of your own and select it by its `module:function` path."
    )


def unbuilt_reward_warning(name: str, kind: str) -> str | None:
    """For `safe-trainers check`: the warning for a reward name the launch scripts cannot build (they refuse it at
    start-up, see [`reward_name_problem`]), or `None` for a name they build."""
    problem = reward_name_problem(name)
    if problem is None:
        return None
    return (
        f"`reward_funcs` names {name!r}, which the shipped launch scripts cannot build: `launch/train_{kind}.py` will "
        f"refuse this config at start-up. A training script of your own may resolve the name; the rules were run on "
        f"the rest of the config. {problem}"
    )


def trl_reward(name: str) -> RewardFunc:
    """TRL's reward function `name` (see `TRL_REWARDS`), built as TRL's scripts build it."""
    import trl.rewards

    attribute, factory_kwargs = TRL_REWARDS[name]
    func = getattr(trl.rewards, attribute)
    return func(**factory_kwargs) if factory_kwargs is not None else func


def load_reward_func(name: str) -> RewardFunc:
    """The reward function selected by `name`: a built-in name (see `BUILTIN_REWARDS`), one of TRL's names (see
    `TRL_REWARDS`), or a `module:function` path.

    A dotted `module.function` path is accepted too, as TRL's scripts do. The current directory is searched after the
    usual import path, so a `my_rewards.py` next to where the job is launched is found.

    Raises:
        InputError: (a `ValueError`) for an unknown name, a module that cannot be imported, or a missing or
            non-callable attribute: a mistake in the input, which the launch scripts print as one message.
    """
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if name in TRL_REWARDS:
        return trl_reward(name)
    problem = reward_name_problem(name)
    if problem is not None:
        raise InputError(text=problem)
    module_name, _, attribute = name.partition(":") if ":" in name else name.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise InputError(
            text=f"Could not import module `{module_name}` for the reward function {name!r} in `reward_funcs`: "
            f"{error}. Make sure the module is on `PYTHONPATH` (or in the current directory)."
        ) from error
    func = getattr(module, attribute, None)
    if not callable(func):
        raise InputError(
            text=f"Module `{module_name}` has no callable `{attribute}` (from {name!r} in `reward_funcs`). Define "
            f"`def {attribute}(completions, **kwargs) -> list[float]` in it."
        )
    return func


def load_reward_funcs(names: list[str]) -> list[RewardFunc | str]:
    """The reward functions for `names`, in order. A name that is an existing local directory is passed through as
    a reward-model path (GRPO scores with it)."""
    if not names:
        raise InputError(
            text="`reward_funcs` is empty: GRPO needs at least one reward. Use a built-in name "
            f"({', '.join(BUILTIN_REWARDS)}), one of TRL's ({', '.join(TRL_REWARDS)}) or a `module:function` path."
        )
    return [name if os.path.isdir(name) else load_reward_func(name) for name in names]


__all__ = [
    "BUILTIN_REWARDS",
    "OPEN_R1_REWARDS",
    "TRL_REWARDS",
    "completion_text",
    "count_words",
    "format",
    "length",
    "load_reward_func",
    "load_reward_funcs",
    "make_format_reward",
    "open_r1_hint",
    "reward_name_problem",
    "unbuilt_reward_warning",
    "trl_reward",
]
