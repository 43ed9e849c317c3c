"""One family-by-name table for the shim, `check` and the trainers (issue 12, item 4): a Hub id that cannot be read
offline still gets its family's rules, and the report says the family was inferred from the name."""

from __future__ import annotations

import pytest
from rule_utils import make_args

import safe_trainers.openrlhf.models as shim_models
from safe_trainers.cli.main import main
from safe_trainers.rules.families import family_from_name
from safe_trainers.rules.context import build_setup


GEMMA2_RECIPE = """\
model_name_or_path: google/gemma-2-9b-it
attn_implementation: sdpa
bf16: true
logging_nan_inf_filter: false
report_to: none
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "dpo.yaml"
    path.write_text(text + f"output_dir: {tmp_path / 'out'}\n")
    return str(path)


def test_check_infers_gemma2_from_a_hub_id_it_cannot_read(tmp_path, capsys):
    # HF_HUB_OFFLINE=1: `config.json` of the Hub id cannot be read; before, no attention finding at all.
    config = write(tmp_path, GEMMA2_RECIPE)
    assert main(["check", "--trainer", "dpo", "--config", config, "--target-hardware", "H100"]) == 1
    out = capsys.readouterr().out
    assert "[fixed] attention.gemma2_no_flash" in out and "'sdpa' -> 'eager'" in out
    assert "`google/gemma-2-9b-it` is a `gemma2` model, inferred from the name" in out


def test_a_gemma_recipe_for_a_gpu_without_bf16_is_not_advised_fp16(tmp_path, capsys):
    recipe = GEMMA2_RECIPE.replace("attn_implementation: sdpa", "attn_implementation: eager")
    main(["check", "--trainer", "dpo", "--config", write(tmp_path, recipe), "--target-hardware", "V100"])
    out = capsys.readouterr().out
    assert "[warned] precision.bf16_supported" in out
    assert "`gemma2` overflows fp16" in out and "Use fp16 mixed precision" not in out


def test_the_trainers_setup_infers_the_family_only_from_a_recognised_name():
    setup = build_setup("dpo", make_args("dpo"), "google/gemma-2-2b-it")
    assert setup.inferred_family == "gemma2" and setup.model_types == {"gemma2"}
    assert setup.text_config.attn_logit_softcapping == 50.0  # transformers' Gemma-2 default
    assert "inferred from the name" in setup.assumptions[0]
    unknown = build_setup("dpo", make_args("dpo"), "acme/house-model-7b")  # no pattern: no guess, no finding
    assert unknown.model_config is None and unknown.inferred_family is None and unknown.assumptions == []


def test_a_readable_config_wins_over_the_name(toy_models):
    setup = build_setup("dpo", make_args("dpo"), toy_models["qwen2"])
    assert setup.inferred_family is None and setup.model_types == {"qwen2"}


@pytest.mark.parametrize(
    "name,family",
    [("google/gemma-2-9b-it", "gemma2"), ("google/gemma-2b", "gemma"), ("Qwen/Qwen2.5-7B", "qwen2"), ("x/y", None)],
)
def test_one_table_for_the_shim_and_the_trainers(name, family):
    assert family_from_name(name) == family
    assert shim_models.family_from_name is family_from_name  # the shim reads the same table
    info = shim_models.inspect_model("--pretrain", name, reader=lambda path: None)
    assert info.model_type == family and (info.source == "name") == (family is not None)
