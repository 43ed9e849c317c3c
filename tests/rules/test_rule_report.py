"""The safety report: rendering, views by rule and action, and the JSON file."""

from __future__ import annotations

import json
import os

import torch

from safe_trainers import SafetyReport
from safe_trainers.rules.report import Change, Finding, REMOVED
from safe_trainers.rules import DEFAULT_RULES
from safe_trainers.testing.build import build_trainer


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


def _sample_report():
    return SafetyReport(
        trainer="dpo",
        mode="fix",
        findings=[
            Finding("optim.grad_clip", "skipped", "disabled by `safety_disable_rules`."),
            Finding(
                "precision.bf16_over_fp16",
                "fixed",
                "fp16 switched to bf16.",
                (
                    Change("args.fp16", True, False),
                    Change("args.model_init_kwargs.dtype", REMOVED, "bfloat16"),
                    Change("args.model_init_kwargs.torch_dtype", torch.float16, REMOVED),
                ),
                {"internal": object()},
            ),
            Finding("logging.show_nonfinite", "warned", "would turn the filter off."),
        ],
    )


def test_report_render():
    text = _sample_report().render()
    lines = text.splitlines()
    assert lines[0] == "safe_trainers (dpo, safety_mode='fix'): 1 fixed, 1 warned, 1 skipped."
    assert any(line.startswith("  [skipped] optim.grad_clip") for line in lines)
    assert any(
        line.startswith("  [fixed] precision.bf16_over_fp16") and "fp16 switched to bf16." in line for line in lines
    )
    assert any(line.strip() == "args.fp16: True -> False" for line in lines)
    assert any(line.strip() == "args.model_init_kwargs.dtype: <removed> -> 'bfloat16'" for line in lines)
    assert any(line.strip() == "args.model_init_kwargs.torch_dtype: torch.float16 -> <removed>" for line in lines)
    assert lines[-1].startswith("  Disable a rule with `safety_disable_rules=[<rule id>]`")


def test_report_render_empty_and_off():
    assert SafetyReport("kto", "fix").render() == "safe_trainers (kto): all safety rules passed, nothing changed."
    off = SafetyReport("grpo", "off", [Finding("x", "fixed", "ignored")])
    assert off.render() == 'safe_trainers (grpo): safety rules are off (`safety_mode="off"`).'


def test_change_render_truncates_long_values():
    text = Change("args.model_init_kwargs.x", "a" * 200, 1).render()
    old = text.split(": ", 1)[1].split(" -> ")[0]
    assert len(old) == 80 and old.endswith("...")


def test_report_views():
    report = _sample_report()
    assert [f.action for f in report.by_rule("precision.bf16_over_fp16")] == ["fixed"]
    assert report.by_rule("nope") == []
    assert [c.path for c in report.changes] == [
        "args.fp16",
        "args.model_init_kwargs.dtype",
        "args.model_init_kwargs.torch_dtype",
    ]


def test_report_write_json(tmp_path):
    out = tmp_path / "new" / "dir"
    path = _sample_report().write_json(str(out))
    assert path == os.path.join(str(out), "safety_report.json")
    assert sorted(os.listdir(out)) == ["safety_report.json"]  # no temporary file left behind
    data = json.loads(open(path).read())
    assert data["trainer"] == "dpo" and data["mode"] == "fix"
    assert [f["rule_id"] for f in data["findings"]] == [
        "optim.grad_clip",
        "precision.bf16_over_fp16",
        "logging.show_nonfinite",
    ]
    fixed = data["findings"][1]
    assert fixed["action"] == "fixed" and fixed["message"] == "fp16 switched to bf16."
    assert fixed["changes"] == [
        {"path": "args.fp16", "old": True, "new": False},
        {"path": "args.model_init_kwargs.dtype", "old": "<removed>", "new": "bfloat16"},
        {"path": "args.model_init_kwargs.torch_dtype", "old": "torch.float16", "new": "<removed>"},
    ]
    assert "data" not in fixed  # internal detail stays out of the report
    # a second write replaces the file and can use another name
    assert SafetyReport("dpo", "warn").write_json(str(out)) == path
    assert json.loads(open(path).read()) == {"trainer": "dpo", "mode": "warn", "findings": []}
    other = SafetyReport("kto", "fix").write_json(str(out), filename="other.json")
    assert os.path.basename(other) == "other.json"


def test_finding_to_dict_jsonable_values():
    finding = Finding("x", "fixed", "m", (Change("a", {"k": (1, 2)}, [torch.float16, None]),))
    assert finding.to_dict()["changes"] == [{"path": "a", "old": {"k": [1, 2]}, "new": ["torch.float16", None]}]
    json.dumps(finding.to_dict())


# --------------------------------------------------------------------------------------------------------------------
# On a real safe trainer, built (and where the claim needs it, trained) from a tiny model
# --------------------------------------------------------------------------------------------------------------------


def test_a_clean_construction_prints_one_line(toy_models, tmp_path, caplog):
    # It printed nothing (the report was logged at INFO), while the README says the main process prints the report.
    settings = dict(rows=4, max_grad_norm=0.5, logging_nan_inf_filter=False)
    with caplog.at_level("WARNING", logger="safe_trainers"):
        trainer = build_trainer("reward", toy_models["qwen2-rm"], tmp_path / "a", **settings)
    path = os.path.join(trainer.args.output_dir, "safety_report.json")
    assert trainer.safety_report.findings == [] and os.path.isfile(path)
    lines = [r.getMessage() for r in caplog.records if r.name == "safe_trainers"]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    count = lines[0].split(": ", 1)[1].split(" ")[0]
    guard = "NaN guard on (snapshots adapt to <= 1% of wall time, every >= 1 steps)"  # no step checkpoints: no cap
    assert lines[0] == f"safe_trainers (reward): {count} safety rules run, none fired; {guard}; report in {path}."
    assert int(count) == sum("reward" in r.trainers for r in DEFAULT_RULES)
    caplog.clear()
    with caplog.at_level("WARNING", logger="safe_trainers"):
        trainer = build_trainer("reward", toy_models["qwen2-rm"], tmp_path / "b", nan_guard=False,
                                safety_disable_rules=["optim.grad_clip"], **settings)  # fmt: skip
    [line] = [r.getMessage() for r in caplog.records if r.name == "safe_trainers"]
    assert f"{int(count) - 1} safety rules run, none fired (1 disabled: `optim.grad_clip`)" in line
    assert "; NaN guard off (`nan_guard=False`); " in line
