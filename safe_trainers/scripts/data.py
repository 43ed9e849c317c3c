"""The training (and evaluation) data of the launch scripts: a `datasets:` mixture, a Hub id, a local file or folder,
or the toy dataset of the trainer kind."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..kinds import get_kind
from ..testing import toy
from .inputs import InputError
from .places import DATA_FILE_BUILDERS

if TYPE_CHECKING:
    from datasets import Dataset

    from .arguments import ScriptArguments


def load_split(kind: str, script_args: ScriptArguments, split: str) -> Dataset:
    """One split of the dataset named by `script_args.dataset_name`: a hub id (`datasets.load_dataset`), a local JSON,
    JSONL or Parquet file or a saved `Dataset` (the training split only), a `save_to_disk` `DatasetDict`, or a folder
    of data files (its splits named by the files, as `load_dataset` reads them).
    A `datasets:` mixture ([`~trl.DatasetMixtureConfig`]) wins over `dataset_name`, as in TRL's scripts. With neither,
    the deterministic toy dataset for `kind`."""
    from datasets import DatasetDict, load_dataset, load_from_disk  # on use: `safe-trainers check` loads no data

    get_kind(kind)
    if script_args.datasets:  # a `datasets:` mixture, loaded as TRL's scripts load it
        return _mixture_split(script_args, split)
    name = script_args.dataset_name
    if not name:
        return toy.dataset_for(kind)
    extension = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        if extension not in DATA_FILE_BUILDERS:
            raise InputError(
                text=f"`dataset_name={name!r}` is a file with an unsupported extension {extension!r}. Use a "
                f"{', '.join(DATA_FILE_BUILDERS)} file, a `save_to_disk` folder or a dataset id."
            )
        _one_split(name, split, script_args)
        return load_dataset(DATA_FILE_BUILDERS[extension], data_files={split: name}, split=split)
    if os.path.isdir(name) and _is_saved_to_disk(name):
        dataset = load_from_disk(name)
        if isinstance(dataset, DatasetDict):
            return _split_of(dataset, split, f"The dataset saved at {name!r}")
        _one_split(name, split, script_args)
        return dataset
    if os.path.isdir(name):  # data files in a folder: its splits come from the file names (`train.jsonl`, ...)
        folder = load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
        return _split_of(folder, split, f"The folder {name!r}")
    return load_dataset(name, name=script_args.dataset_config, split=split, streaming=script_args.dataset_streaming)


def _split_of(splits: Any, split: str, what: str) -> Dataset:
    if split not in splits:
        raise InputError(
            text=f"{what} has no split {split!r}; its splits are {list(splits)}. Set `dataset_train_split` (or "
            "`dataset_test_split`) to one of them."
        )
    return splits[split]


def _one_split(name: str, split: str, script_args: ScriptArguments) -> None:
    """A single file (or a saved `Dataset`) is the training split only: evaluating on it would score the training
    rows, so another split is refused."""
    train = script_args.dataset_train_split
    if split != train:
        raise InputError(
            text=f"`dataset_name={name!r}` holds one split, read as the training split {train!r}, so it has no split "
            f"{split!r} to evaluate on. Pass a folder with a file per split (`{train}.jsonl`, `{split}.jsonl`) or a "
            f"`save_to_disk` `DatasetDict`, set `--eval_strategy no`, or `--dataset_test_split {train}` to evaluate "
            "on the training rows."
        )


def _mixture_split(script_args: ScriptArguments, split: str) -> Dataset:
    import trl

    mixture = trl.get_dataset(script_args)
    if split not in mixture:
        raise InputError(
            text=f"The `datasets` mixture has no split {split!r}; its splits are {list(mixture)}. Set "
            "`dataset_train_split` (or `dataset_test_split`) to one of them, or `test_split_size` to split off a test "
            "set."
        )
    return mixture[split]


def load_checked_split(kind: str, script_args: ScriptArguments, training_args: Any, split: str) -> Dataset:
    """[`load_split`], with a failure to read the user's data and a split without rows or columns the trainer reads
    raised as an [`InputError`] (before the model is loaded)."""
    from datasets.exceptions import DatasetGenerationError

    from . import preflight

    name = script_args.dataset_name
    try:
        dataset = load_split(kind, script_args, split)
    except (ConnectionError, FileNotFoundError, DatasetGenerationError) as error:
        wrapped = preflight.load_error(None if script_args.datasets else name, error)
        if wrapped is None:
            raise
        raise wrapped from error
    preflight.check_data(kind, name, dataset, split, training_args)
    return dataset


def load_train_dataset(kind: str, script_args: ScriptArguments) -> Dataset:
    """The training split (`script_args.dataset_train_split`); see [`load_split`] for the accepted sources."""
    return load_split(kind, script_args, script_args.dataset_train_split)


def _is_saved_to_disk(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


__all__ = ["load_checked_split", "load_split", "load_train_dataset"]
