"""Replay bundles (`output_dir/nan_replay/step-N/`) and `safe-trainers replay`: the demo's run writes one bundle per
faulted step and the replay on the CPU names the same first non-finite module and rows as the in-loop diagnosis for
both of its faults; a data-borne fault (one token's embedding row) is traced to the rows holding that token; a GRPO
bundle holds prompts, completions, rewards and log-probs; bundles are bounded and rotated; no bundle: exit 2."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import TrainerCallback

from safe_trainers.arguments import SafetyArguments
from safe_trainers.cli.demo_run import unsafe_trainer
from safe_trainers.cli.main import main
from safe_trainers.guard import read_events
from safe_trainers.replay import bundle_steps, fit, read_bundle, rotate_bundles, write_bundle
from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault
from safe_trainers.testing.toy import dataset_for


@pytest.fixture(scope="module")
def demo_run(toy_models, tmp_path_factory):
    """The demo's guarded run (DPO on the tiny Gemma-2, NaN loss at step 6, NaN weight at step 9), as the demo builds
    it, on the CPU."""
    out = str(tmp_path_factory.mktemp("demo") / "safe")
    faults = [Fault(step=6, kind="loss"), Fault(step=9, kind="weight")]
    trainer = unsafe_trainer(toy_models["gemma2"], out, 12, dataset_for("dpo", 64), faults)
    trainer.args.use_cpu = True
    trainer.train()
    return out


def replay_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["replay", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def in_loop(out: str, step: int) -> dict:
    return next(e for e in read_events(out) if e["step"] == step and e["kind"] == "skip")["first_nonfinite_module"]


def test_the_demo_writes_a_bundle_for_each_faulted_step_only(demo_run):
    assert bundle_steps(demo_run) == [6, 9]  # no bundle for a clean step
    meta6, args6, payload6 = read_bundle(demo_run, 6)
    assert meta6["events"] == ["skip"] and meta6["checkpoint"] == "checkpoint-4" and meta6["kind"] == "dpo"
    assert meta6["faults"] == [{"step": 6, "kind": "loss", "rank": None, "value": "nan", "repeat": 1,
                                "micro_batch": None}]  # fmt: skip
    assert sorted(payload6["micro_batches"]) == [0] and "input_ids" in payload6["micro_batches"][0]
    assert meta6["nonfinite_state"] == [] and sum(meta6["bytes"].values()) <= meta6["max_bytes"]
    assert args6["learning_rate"] == 1e-3 and args6["hub_token"] in (None, "<hidden>")
    meta9, _, payload9 = read_bundle(demo_run, 9)
    assert meta9["events"] == ["skip", "rollback"] and meta9["checkpoint"] == "checkpoint-8"
    (name, entry), = payload9["state"].items()  # the NaN weight, as its non-finite entries
    assert name == meta9["nonfinite_state"][0] and entry["index"].tolist() == [0] and entry["value"].isnan().all()
    assert meta9["in_loop_diagnosis"] == in_loop(demo_run, 9)


@pytest.mark.parametrize("step", [6, 9])
def test_the_replay_reproduces_the_demos_in_loop_diagnosis(demo_run, capsys, step):
    code, out, _ = replay_cli(capsys, demo_run, "--step", str(step))
    expected = in_loop(demo_run, step)
    assert code == 0, out
    replayed = next(line for line in out.splitlines() if line.startswith("replay:"))
    assert f"first non-finite module: {expected['module']} ({expected['type']})" in replayed
    assert f"rows {expected['rows']}" in replayed
    assert "agrees with the in-loop diagnosis: yes" in out
    if step == 6:  # the injected activation is a test tool's: re-armed, and said so
        assert "re-armed test faults: Fault(step=6, kind='loss')" in out
    else:  # the NaN weight is replayed from the state the bundle holds, as a real one would be
        assert "non-finite state written over the checkpoint: model.layers.0.self_attn.q_proj.weight" in out
        assert "re-armed test faults" not in out and "test fault not re-armed: Fault(step=9, kind='weight')" in out


def test_no_bundle_for_the_step_exits_2_and_lists_the_steps_with_one(demo_run, capsys):
    code, out, err = replay_cli(capsys, demo_run, "--step", "7")
    assert code == 2 and out == ""
    assert "no replay bundle for step 7 (the steps with one: 6, 9)" in err and "`--step`" in err


class NanTokenEmbedding(TrainerCallback):
    """At step `step`'s first training forward, one token's row of the (frozen) embedding becomes NaN: a token
    found in some rows of the batch but not in its last. Keeps the rows that hold it."""

    def __init__(self, step: int):
        self.step, self.rows, self._armed, self._handle = step, None, False, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        embed = model.get_input_embeddings()
        self._handle = embed.register_forward_pre_hook(lambda module, inputs: self._poison(module, inputs[0]))

    def on_step_begin(self, args, state, control, **kwargs):
        self._armed = state.global_step + 1 == self.step and self.rows is None

    def _poison(self, embed, ids):
        if not (self._armed and torch.is_grad_enabled()):
            return
        self._armed = False
        token = next(int(t) for t in ids[0].unique() if not bool((ids[-1] == t).any()))
        self.rows = [i for i in range(ids.shape[0]) if bool((ids[i] == token).any())]
        with torch.no_grad():
            embed.weight[token] = float("nan")

    def on_train_end(self, args, state, control, **kwargs):
        self._handle.remove()


def test_a_data_borne_fault_is_traced_to_its_module_and_rows(toy_models, tmp_path, capsys):
    out = str(tmp_path)
    trainer = build_trainer("sft", toy_models["qwen2"], out, preset="guarded", bf16=False, max_steps=4,
                            save_steps=2, per_device_train_batch_size=4)  # fmt: skip
    trainer.model.get_input_embeddings().weight.requires_grad_(False)
    poison = NanTokenEmbedding(step=3)
    trainer.add_callback(poison)
    trainer.train()
    assert poison.rows and len(poison.rows) < 4  # some rows hold the token, not all
    assert in_loop(out, 3)["module"] == "model.embed_tokens" and in_loop(out, 3)["rows"] == poison.rows
    code, text, _ = replay_cli(capsys, out, "--step", "3")
    assert code == 0, text
    assert f"replay:  first non-finite module: model.embed_tokens (Embedding), micro-batch 0 of 1, rows {poison.rows}" \
        in text  # fmt: skip
    assert "non-finite state written over the checkpoint: model.embed_tokens.weight" in text
    assert "agrees with the in-loop diagnosis: yes" in text and "re-armed" not in text  # no test fault at all


def test_a_grpo_bundle_holds_prompts_completions_rewards_and_log_probs(toy_models, tmp_path):
    out = str(tmp_path)
    trainer = build_trainer("grpo", toy_models["qwen2"], out, preset="guarded", faults=[Fault(step=3, kind="loss")],
                            max_steps=4, save_steps=2, num_iterations=2)  # fmt: skip
    trainer.train()
    assert bundle_steps(out) == [3]
    meta, _, payload = read_bundle(out, 3)
    batch = payload["micro_batches"][0]
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps"):
        assert torch.is_tensor(batch[key]), key
    assert batch["old_per_token_logps"].shape == batch["completion_ids"].shape
    assert payload["rewards"].shape == (batch["completion_ids"].shape[0], 1)
    assert meta["reward_funcs"] == ["count_words_reward"] and meta["kind"] == "grpo"


def test_bundles_are_bounded_and_rotated(toy_models, tmp_path):
    out = str(tmp_path)
    faults = [Fault(step=s, kind="loss") for s in (3, 5, 7)]
    probe = build_trainer("sft", toy_models["qwen2"], str(tmp_path / "probe"), preset="guarded")
    one = sum(t.numel() * t.element_size() for t in next(iter(probe.get_train_dataloader())).values())
    trainer = build_trainer("sft", toy_models["qwen2"], out, preset="guarded", faults=faults, bf16=False,
                            max_steps=8, gradient_accumulation_steps=2, nan_replay_max_bytes=one + one // 2,
                            nan_replay_limit=2)  # fmt: skip
    trainer.train()
    assert bundle_steps(out) == [5, 7]  # step 3's rotated out, oldest first
    meta, _, payload = read_bundle(out, 7)
    assert meta["micro_batches"] == 2 and sorted(payload["micro_batches"]) == [0]  # what fits: one micro-batch
    assert list(meta["left_out"]) == ["micro_batch.1"] and sum(meta["bytes"].values()) <= meta["max_bytes"]


def test_fit_keeps_what_fits_in_order_and_rotation_keeps_the_newest(tmp_path):
    items = [("a", torch.zeros(4)), ("b", torch.zeros(8)), ("c", torch.zeros(2))]
    kept, sizes, left_out = fit(items, 30)
    assert list(kept) == ["a", "c"] and sizes == {"a": 16, "c": 8} and left_out == {"b": 32}
    for step in (2, 4, 6, 8):
        write_bundle(str(tmp_path), step, 0, {"micro_batches": {}}, {"step": step}, {})
    assert rotate_bundles(str(tmp_path), 8, 3) == [2] and bundle_steps(str(tmp_path)) == [4, 6, 8]


def test_no_bundle_with_max_bytes_0_and_invalid_settings_are_refused(toy_models, tmp_path):
    trainer = build_trainer("sft", toy_models["qwen2"], str(tmp_path), preset="guarded", bf16=False, max_steps=4,
                            faults=[Fault(step=2, kind="loss")], nan_replay_max_bytes=0)  # fmt: skip
    trainer.train()
    assert [e["kind"] for e in read_events(str(tmp_path))] == ["skip"] and bundle_steps(str(tmp_path)) == []
    assert not os.path.exists(os.path.join(str(tmp_path), "nan_replay"))
    with pytest.raises(ValueError, match=r"`nan_replay_max_bytes` must be an integer >= 0 .*got -1"):
        SafetyArguments(nan_replay_max_bytes=-1)
    with pytest.raises(ValueError, match=r"`nan_replay_limit` must be an integer >= 1 .*got 0"):
        SafetyArguments(nan_replay_limit=0)
