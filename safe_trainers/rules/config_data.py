"""A model's `config.json` read as data, for a lint that must not run the model repository's own code.

With `trust_remote_code=True`, `AutoConfig.from_pretrained` imports the repository's `configuration_*.py` (and
downloads it from the Hub). `safe-trainers check` lints without running it unless asked (`--run-model-code`): it
reads the config with transformers' own class for its `model_type` when there is one (transformers ignores the
repository's `auto_map` then), else the file's fields as a plain `PretrainedConfig`, and says so in the report.
"""

from __future__ import annotations

from typing import Any


def config_as_data(model: str, revision: str | None = None) -> Any:
    """The `PretrainedConfig` of `config.json` at `model` (a folder, or a Hub id through the cache or the Hub), its
    fields as they are in the file (a sub-config holding a `model_type` as a `PretrainedConfig` too); no code of the
    repository is imported. `None` when there is no readable `config.json`."""
    from transformers import PretrainedConfig

    try:
        fields, _ = PretrainedConfig.get_config_dict(model, revision=revision)
    except (OSError, ValueError):
        return None
    fields = {key: _sub_config(value) for key, value in fields.items() if key != "auto_map"}
    return PretrainedConfig.from_dict(fields)


def _sub_config(value: Any) -> Any:
    from transformers import PretrainedConfig

    if isinstance(value, dict) and "model_type" in value:  # `text_config`, `vision_config`, ...; not a plain mapping
        return PretrainedConfig.from_dict(value)
    return value


def code_not_run_note(model_config: Any, tokenizer_read: bool | None) -> str:
    """The report's line for a model whose own code the check did not run. Pure.

    Args:
        model_config (`PretrainedConfig | None`): the config the rules read.
        tokenizer_read (`bool | None`): whether the tokenizer could be read without the model's code (`None` when the
            trainer reads none at construction).
    """
    if model_config is None:
        how = "no `config.json` could be read as data either"
    elif type(model_config).__name__ in ("PretrainedConfig", "PreTrainedConfig"):
        how = "its `config.json` was read as plain data, so the rules saw the file's fields but none of the defaults " \
              "its config class would add"  # fmt: skip
    else:
        how = f"its `config.json` was read with transformers' own `{model_config.model_type}` config class"
    tokenizer = "; no tokenizer could be read without it, so the tokenizer rules were not checked" if (
        tokenizer_read is False) else ""  # fmt: skip
    return (f"`trust_remote_code=True`: the model's own code was not run ({how}{tokenizer}). Pass "
            "`--run-model-code` to `safe-trainers check` to run it, as the trainer will.")  # fmt: skip


__all__ = ["code_not_run_note", "config_as_data"]
