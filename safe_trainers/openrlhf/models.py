"""What the rules need to know about the models of a command: family and attention soft-capping.

A local checkpoint directory is read through its `config.json` (no transformers import, no network); a Hub id or a
path that does not exist here is recognised from its name by the package's one family table (`safe_trainers.rules.families`:
"Qwen/Qwen2-7B" -> `qwen2`, "google/gemma-2-2b-it" -> `gemma2`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..rules.families import family_from_name


# Qwen2-architecture model types (Qwen1.5, Qwen2, Qwen2.5, QwQ and the R1 distills all use `qwen2`).
QWEN2_FAMILY = frozenset(
    {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text", "qwen2_audio"}
)
# transformers' `Gemma2Config.attn_logit_softcapping` default: a saved config may leave it out.
DEFAULT_SOFTCAP = {"gemma2": 50.0}

@dataclass(frozen=True)
class ModelInfo:
    """One model named by the command.

    Args:
        flag (`str`): the flag that names it, e.g. `"--pretrain"`.
        path (`str`): the value given (one entry of a comma-separated list).
        model_type (`str | None`): `config.json`'s `model_type`, or the family recognised from the name.
        text_model_type (`str | None`): the `model_type` of the text sub-config of a multimodal model.
        softcap (`float | None`): `attn_logit_softcapping` (of the text config when there is one).
        source (`str`): `"config"` (read from `path/config.json`), `"name"` (recognised from the name) or `"unknown"`.
    """

    flag: str
    path: str
    model_type: str | None
    text_model_type: str | None = None
    softcap: float | None = None
    source: str = "unknown"

    @property
    def types(self) -> frozenset[str]:
        return frozenset(t for t in (self.model_type, self.text_model_type) if t)

    def describe(self) -> str:
        kind = self.model_type or "unknown family"
        where = {"config": "config.json", "name": "from its name"}.get(self.source, "not recognised")
        return f"`{self.path}` ({kind}, {where})"


def info_from_config(flag: str, path: str, config: dict[str, Any]) -> ModelInfo:
    """A `ModelInfo` from a parsed `config.json` (pure)."""
    model_type = config.get("model_type")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    text_type = text.get("model_type") if text else None
    source = text if text is not None and "attn_logit_softcapping" in text else config
    if "attn_logit_softcapping" in source:
        softcap = source["attn_logit_softcapping"]
    else:
        softcap = DEFAULT_SOFTCAP.get(text_type or "") or DEFAULT_SOFTCAP.get(model_type or "")
    return ModelInfo(flag, path, model_type, text_type, softcap, "config")


def read_config(path: str) -> dict[str, Any] | None:
    """`path/config.json` parsed, or `None` when `path` is not a local directory with a readable config."""
    config_file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(config_file):
        return None
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def inspect_model(
    flag: str, path: str, reader: Callable[[str], dict[str, Any] | None] = read_config
) -> ModelInfo:
    """Describe the model at `path`: from its `config.json` when `reader` finds one, else from its name."""
    config = reader(path)
    if config is not None:
        return info_from_config(flag, path, config)
    model_type = family_from_name(path)
    if model_type is None:
        return ModelInfo(flag, path, None)
    return ModelInfo(flag, path, model_type, None, DEFAULT_SOFTCAP.get(model_type), "name")


__all__ = ["ModelInfo", "QWEN2_FAMILY", "info_from_config", "inspect_model", "read_config"]
