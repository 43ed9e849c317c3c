"""What this machine holds under the names a user gives: the `--config` file, the model and the dataset.

The actions at the edge of the input checks ([`~safe_trainers.scripts.inputs`]): look at the file system and the local
Hugging Face caches, and ask the Hub only when a name can only be found there and the Hub is reachable. The checks
themselves are pure functions of what is observed here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal


# The local data files the launch scripts load (`scripts.data`), by extension, and the `datasets` builder of each.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
DATA_FILE_EXTENSIONS = tuple(DATA_FILE_BUILDERS)
MODEL_FILES = ("config.json", "adapter_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")  # the weight files `from_pretrained` can read
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Keys that only a launcher's config has: `accelerate config` files and DeepSpeed JSON files.
ACCELERATE_KEYS = frozenset({"compute_environment", "distributed_type"})
DEEPSPEED_KEYS = frozenset({"zero_optimization", "train_micro_batch_size_per_gpu"})
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


@dataclass(frozen=True)
class ConfigFile:
    """The YAML `--config` file as found here.

    Args:
        path (`str`): the path given.
        state (`str`): `"mapping"` (readable, a mapping of settings), `"missing"`, `"directory"`, `"not_mapping"`,
            `"accelerate"` or `"deepspeed"` (a launcher's config given where the trainer's settings belong), or
            `"unreadable"` (a YAML syntax or read error, in `error`).
        error (`str`): the reader's complaint, for `"unreadable"`.
        settings (`dict`): the top-level settings, for `"mapping"` (empty otherwise).
    """

    path: str
    state: Literal["mapping", "missing", "directory", "not_mapping", "accelerate", "deepspeed", "unreadable"]
    error: str = ""
    settings: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Place:
    """What this machine holds under one model or dataset name.

    Args:
        name (`str`): the name given (a path or a Hub id).
        kind (`str`): `"dir"`, `"file"` or `"missing"` (nothing at that path here).
        absolute (`str`): the path the name means here, for messages.
        hub_id (`bool`): whether the name could be a Hub id (`org/name` or `name`, not a path form nor a data file).
        model_files (`bool`): a directory holding `config.json` or `adapter_config.json`.
        weights (`bool`): a directory holding a weight file (`*.safetensors`, `*.bin`, ...).
        unexpanded_home (`bool`): the name starts with `~` (not expanded here) and the path it stands for exists.
        missing_shards (`tuple[str, ...]`): the weight shards a directory's shard index names but that are not there.
        empty (`bool`): a file holding nothing but whitespace.
        cached (`bool`): a Hub id found in the local Hugging Face cache.
        on_hub (`bool`, *optional*): the Hub's answer about the id; `None` when not asked (offline, local, cached).
    """

    name: str
    kind: Literal["dir", "file", "missing"]
    absolute: str
    hub_id: bool = False
    model_files: bool = False
    weights: bool = False
    unexpanded_home: bool = False
    missing_shards: tuple[str, ...] = ()

    @property
    def model_lacks(self) -> str | None:
        """What a directory lacks to be loaded as a model (`config.json`, the shards its index names, any weight
        file), or `None`."""
        if not self.model_files:
            return "`config.json`"
        if self.missing_shards:
            return f"the weight shards its index names: {list(self.missing_shards)}"
        return None if self.weights else "`*.safetensors` or `*.bin` weights"
    empty: bool = False
    cached: bool = False
    on_hub: bool | None = None


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hub repository id: not absolute, not `./` `../` `~`, at most one `/`, and
    not ending in a data-file extension. Pure."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.lower().endswith(DATA_FILE_EXTENSIONS)


def needs_hub(names: list[str | None]) -> bool:
    """Whether any of `names` can only be found through the Hub (or its cache): a Hub id with nothing at that path."""
    return any(name and is_hub_id(name) and not os.path.exists(name) for name in names)


def read_config_file(path: str) -> ConfigFile:
    """Look at the `--config` file: present, a file, valid YAML, a mapping."""
    import yaml

    if not os.path.exists(path):
        return ConfigFile(path, "missing")
    if os.path.isdir(path):
        return ConfigFile(path, "directory")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as error:
        return ConfigFile(path, "unreadable", " ".join(str(error).split()))
    if isinstance(data, dict) and (data.keys() & ACCELERATE_KEYS or data.keys() & DEEPSPEED_KEYS):
        return ConfigFile(path, "accelerate" if data.keys() & ACCELERATE_KEYS else "deepspeed")
    # An empty file holds no mapping either: TRL's parser refuses it too.
    return ConfigFile(path, "mapping", settings=data) if isinstance(data, dict) else ConfigFile(path, "not_mapping")


def observe(name: str, repo_type: Literal["model", "dataset"], online: bool) -> Place:
    """What this machine holds under `name`; the Hub is asked only for a Hub id that is not here and not cached, and
    only when `online`."""
    absolute = os.path.abspath(os.path.expanduser(name))
    hub_id = is_hub_id(name)
    if os.path.isdir(name):
        files = any(os.path.isfile(os.path.join(name, f)) for f in MODEL_FILES)
        weights = any(f.endswith(WEIGHT_SUFFIXES) for f in os.listdir(name))
        return Place(name, "dir", absolute, hub_id, model_files=files, weights=weights, missing_shards=_shards(name))
    if os.path.isfile(name):
        return Place(name, "file", absolute, hub_id, empty=_blank(name))
    if not hub_id:
        return Place(name, "missing", absolute, unexpanded_home=name.startswith("~") and os.path.exists(absolute))
    cached = in_model_cache(name) if repo_type == "model" else in_dataset_cache(name)
    on_hub = _ask_hub(name, repo_type) if online and not cached else None
    return Place(name, "missing", absolute, hub_id=True, cached=cached, on_hub=on_hub)


def local(name: str) -> Place:
    """What this machine holds at the path `name` (no cache, no Hub): a directory, a file, or nothing."""
    kind = "dir" if os.path.isdir(name) else "file" if os.path.isfile(name) else "missing"
    return Place(name, kind, os.path.abspath(os.path.expanduser(name)))


def in_model_cache(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds a `config.json` (or an adapter's) of `repo_id`."""
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in MODEL_FILES)


def in_dataset_cache(repo_id: str) -> bool:
    """Whether the Hub cache or the datasets cache holds anything of the dataset `repo_id` (`datasets` itself then
    decides whether it is enough; a miss there is reported when loading)."""
    from huggingface_hub import constants

    hub_dir = os.path.join(constants.HF_HUB_CACHE, "datasets--" + repo_id.replace("/", "--"))
    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(constants.HF_HOME, "datasets")
    prepared = os.path.join(datasets_cache, repo_id.replace("/", "___"))
    return os.path.isdir(hub_dir) or os.path.isdir(prepared)


def _ask_hub(repo_id: str, repo_type: str) -> bool | None:
    from huggingface_hub import repo_exists

    try:
        return repo_exists(repo_id, repo_type=repo_type)
    except Exception:  # noqa: BLE001 - a failed lookup says nothing about the id; the loader's own error then applies
        return None


def _shards(directory: str) -> tuple[str, ...]:
    """The shard files that the shard indexes in `directory` name and that are not there (an unreadable index is left
    to the loader)."""
    import json

    missing: set[str] = set()
    for index in SHARD_INDEXES:
        try:
            with open(os.path.join(directory, index)) as f:
                files = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        missing |= {file for file in files if not os.path.isfile(os.path.join(directory, file))}
    return tuple(sorted(missing))


def _blank(path: str, chunk: int = 1 << 16) -> bool:
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return False
    return True


__all__ = ["ConfigFile", "Place", "in_dataset_cache", "in_model_cache", "is_hub_id", "local",
           "needs_hub", "observe", "read_config_file"]  # fmt: skip
