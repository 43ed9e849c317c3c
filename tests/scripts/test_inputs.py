"""The input table and the Hub decision as pure functions (`safe_trainers.scripts.inputs`, `.hub`, `.places`)."""

from __future__ import annotations

import math

import pytest

from safe_trainers.scripts import hub
from safe_trainers.scripts.inputs import (
    INPUT_CHECKS, DataShape, Facts, InputError, column_sets, config_path, join_negative_values, judge, normalize_argv,
    render,
)  # fmt: skip
from safe_trainers.scripts.places import ConfigFile, Place, is_hub_id


OFFLINE = hub.HubAccess(False, "no Hub")


def test_every_row_names_a_setting_a_stage_and_a_judge():
    assert {row.stage for row in INPUT_CHECKS} == {"argv", "settings", "data"}
    assert all(row.setting and callable(row.judge) and row.doc for row in INPUT_CHECKS)


@pytest.mark.parametrize("lr", [-1e-5, math.nan, -math.inf])
def test_learning_rate_must_be_finite_and_not_negative(lr):
    [problem] = judge("settings", {"learning_rate": lr}, Facts())
    assert problem.setting == "learning_rate" and not problem.local and "--learning_rate 1e-5" in problem.fix
    assert judge("settings", {"learning_rate": 0.0}, Facts()) == []


def test_a_hub_id_is_judged_by_the_cache_and_the_hub():
    missing = Place("org/model", "missing", "/here/org/model", hub_id=True)
    offline = judge("settings", {"model_name_or_path": "org/model"}, Facts(model=missing, hub=OFFLINE))
    assert [p.local for p in offline] == [True] and "hf download org/model" in offline[0].fix
    cached = Place("org/model", "missing", "/here/org/model", hub_id=True, cached=True)
    assert judge("settings", {"model_name_or_path": "org/model"}, Facts(model=cached, hub=OFFLINE)) == []
    online = hub.HubAccess(True)
    assert judge("settings", {"model_name_or_path": "org/model"}, Facts(model=missing, hub=online)) == []
    absent = Place("org/model", "missing", "/here/org/model", hub_id=True, on_hub=False)
    [problem] = judge("settings", {"model_name_or_path": "org/model"}, Facts(model=absent, hub=online))
    assert "nor a model on the Hugging Face Hub" in problem.problem and "hf auth login" in problem.fix


def test_a_model_directory_needs_its_config():
    bare = Place("m", "dir", "/here/m", hub_id=True)
    [problem] = judge("settings", {"model_name_or_path": "m"}, Facts(model=bare))
    assert "without `config.json`" in problem.problem
    whole = Place("m", "dir", "/m", model_files=True, weights=True)
    assert judge("settings", {"model_name_or_path": "m"}, Facts(model=whole)) == []


def test_a_model_directory_needs_its_weights():
    def problem(place):
        return judge("settings", {"model_name_or_path": "m"}, Facts(model=place))[0].problem

    assert "without `*.safetensors` or `*.bin` weights" in problem(Place("m", "dir", "/m", model_files=True))
    shard = "model-00002-of-00002.safetensors"
    partial = Place("m", "dir", "/m", model_files=True, weights=True, missing_shards=(shard,))
    assert f"without the weight shards its index names: [{shard!r}]" in problem(partial)


def test_dataset_files():
    def one(place):
        return judge("settings", {"dataset_name": place.name}, Facts(dataset=place, hub=OFFLINE))

    assert "empty file" in one(Place("a.jsonl", "file", "/a.jsonl", empty=True))[0].problem
    assert "type the launch scripts do not read" in one(Place("a.csv", "file", "/a.csv"))[0].problem
    assert "does not exist" in one(Place("data/a.jsonl", "missing", "/data/a.jsonl"))[0].problem
    assert one(Place("a.jsonl", "file", "/a.jsonl")) == []


def test_data_columns_any_accepted_set():
    def problems(kind, columns, text_field="text"):
        return judge("data", {"dataset_name": "d"}, Facts(data=DataShape(kind, "train", 4, columns, text_field)))

    assert problems("dpo", ("prompt", "chosen", "rejected")) == []
    assert problems("reward", ("chosen_ids", "rejected_ids")) == []  # pre-tokenized
    assert "`chosen`, `rejected`" in problems("dpo", ("prompt", "answer"))[0].problem
    assert problems("sft", ("body",), text_field="body") == []
    assert column_sets(DataShape("sft", "train", 1, (), "body"))[0] == ("body",)
    [empty] = judge("data", {"dataset_name": "d"}, Facts(data=DataShape("grpo", "test", 0, ("prompt",))))
    assert "no rows in split 'test'" in empty.problem


def test_config_file_states():
    states = [("missing", "names no file"), ("directory", "is a directory"), ("not_mapping", "mapping of settings"),
              ("unreadable", "could not be read as YAML")]  # fmt: skip
    for state, words in states:
        [problem] = judge("argv", {"config": "c.yaml"}, Facts(config=ConfigFile("c.yaml", state)))
        assert words in problem.problem
    assert judge("argv", {"config": "c.yaml"}, Facts(config=ConfigFile("c.yaml", "mapping"))) == []


def test_several_problems_are_one_message():
    problems = judge("settings", {"learning_rate": -1.0, "dataset_name": "a.csv"},
                     Facts(dataset=Place("a.csv", "file", "/a.csv")))  # fmt: skip
    error = InputError(problems)
    assert isinstance(error, ValueError) and str(error) == render(problems)
    assert str(error).startswith("2 settings need a fix:\n  - `learning_rate=-1.0`")


def test_negative_numbers_after_a_space_are_values():
    argv = ["--learning_rate", "-1e-5", "--max_steps", "-1", "--beta", "0.1", "--x", "--y", "-.5", "--z=-2", "-h"]
    assert join_negative_values(argv) == ["--learning_rate=-1e-5", "--max_steps=-1", "--beta", "0.1", "--x",
                                          "--y=-.5", "--z=-2", "-h"]  # fmt: skip
    assert config_path(["--config", "a.yaml"]) == "a.yaml" and config_path(["--config=b.yaml"]) == "b.yaml"
    assert config_path(["--beta", "1"]) is None
    assert normalize_argv(["--config=c.yaml", "--beta", "-0.1"]) == ["--config", "c.yaml", "--beta=-0.1"]


def test_hub_ids_and_paths():
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2") and is_hub_id("models/does-not-exist")
    for path in ("./model", "/abs/model", "~/m", "a/b/c", "../m", "data/train.jsonl"):
        assert not is_hub_id(path), path


def test_the_hub_decision():
    address = ("huggingface.co", 443)
    assert hub.decide("1", address, None) == hub.HubAccess(False, "`HF_HUB_OFFLINE` is set")
    assert hub.decide("0", address, None).online  # the user asked for the Hub: no probe
    assert hub.decide(None, address, True).online
    refused = hub.decide(None, address, False)
    assert not refused.online and "huggingface.co:443" in refused.reason
    assert refused.announcement("train_dpo").startswith("train_dpo: the Hugging Face Hub cannot be reached")
    assert hub.HubAccess(True).announcement("x") is None


def test_the_probe_goes_to_the_proxy_when_one_applies():
    assert hub.hub_address("https://huggingface.co", {}, False) == ("huggingface.co", 443)
    assert hub.hub_address("https://hf-mirror.example:8443", {}, False) == ("hf-mirror.example", 8443)
    proxies = {"https": "http://proxy.corp:3128"}
    assert hub.hub_address("https://huggingface.co", proxies, False) == ("proxy.corp", 3128)
    assert hub.hub_address("https://huggingface.co", proxies, True) == ("huggingface.co", 443)  # NO_PROXY
    assert hub.reachable(("127.0.0.1", 9), timeout=0.5) is False  # discard port: nothing listens
