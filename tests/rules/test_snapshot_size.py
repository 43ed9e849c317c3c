"""The snapshot's host memory (`safe_trainers.rules.snapshot_size`): the estimate by hand, the estimate against a
real snapshot, and the table in docs/guard.md generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from safe_trainers.rules.snapshot_size import RunShape, memory_table, per_node_bytes, per_rank_bytes
from safe_trainers.rules.stages import snapshot_facts
from safe_trainers.testing.build import build_trainer

DOCS = Path(__file__).resolve().parents[2] / "docs"
B7, LORA7 = 7_000_000_000, 40_000_000
LORA7_STATE = 12 * LORA7  # the adapters' fp32 weights and two fp32 moments; the frozen base is never copied


@pytest.mark.parametrize(
    "run,rank_bytes,node_bytes",
    [
        # DDP, full fine-tune: fp32 weights and two fp32 moments, one copy shared out over the ranks (each keeps
        # 1/N); 8 ranks on each node hold an eighth of it.
        (RunShape("", B7, B7, "ddp", world_size=64), 12 * B7 // 64, 12 * B7 // 8),
        (RunShape("", B7, B7, "ddp", world_size=8), 12 * B7 // 8, 12 * B7),
        # FSDP2 and ZeRO-3 shard the same 12 bytes per parameter (ZeRO: master + moments, no 16-bit weights).
        (RunShape("", B7, B7, "fsdp2", world_size=8), 12 * B7 // 8, 12 * B7),
        (RunShape("", B7, B7, "zero3", world_size=64), 12 * B7 // 64, 12 * B7 // 8),
        # LoRA: the adapters' state only, whatever the strategy (ZeRO's fp32 master stands in for the weights).
        (RunShape("", B7, LORA7, "ddp", world_size=8), LORA7_STATE // 8, LORA7_STATE),
        (RunShape("", B7, LORA7, "fsdp2", world_size=8), LORA7_STATE // 8, LORA7_STATE),
        (RunShape("", B7, LORA7, "zero3", world_size=8), 12 * LORA7 // 8, 12 * LORA7),
        # One GPU; a full fine-tune loaded in bf16 keeps bf16 weights and moments.
        (RunShape("", 1000, 1000, "single", weight_bytes=2, moment_bytes=2), 6000, 6000),
    ],
)
def test_bytes_per_rank_and_node(run, rank_bytes, node_bytes):
    assert (per_rank_bytes(run), per_node_bytes(run)) == (rank_bytes, node_bytes)


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="`strategy='tp'`"):
        per_rank_bytes(RunShape("", 10, 10, "tp"))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_estimate_matches_a_real_snapshot(lora, toy_models, tmp_path):
    peft = {"peft_config": LoraConfig(target_modules=["q_proj", "v_proj"], r=4)} if lora else {}
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, max_steps=1, trainer_kwargs=peft)
    trainer.train()
    trainer.nan_guard.take_snapshot()  # one with the moments (the last step is verified, not copied)
    snapshotter = trainer.nan_guard.snapshotter
    snapshot = snapshotter.snapshot
    held = list(snapshot.params.values())
    held += [v for slot in snapshot.optimizer_state.values() for v in slot.values() if torch.is_tensor(v)]
    held_bytes = sum(t.numel() * t.element_size() for t in held)
    params = list(trainer.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    assert {p.dtype for p in params} == {torch.float32}  # the toy checkpoint is fp32, frozen base included
    # Only what the optimizer changes is held: the frozen base of a LoRA run is not copied.
    names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert set(snapshot.params) == names and (len(names) < len(params)) is lora
    run = RunShape("toy", sum(p.numel() for p in params), sum(p.numel() for p in trainable), "single")
    # The estimate leaves out AdamW's step counters: one fp32 scalar per trainable tensor.
    assert held_bytes - per_rank_bytes(run) == 4 * len(trainable)
    # And the host buffers hold exactly those bytes: one buffer per dtype, no rounding.
    assert snapshotter.held_bytes() == held_bytes


@pytest.mark.parametrize("page", [DOCS / "guard.md", DOCS.parent / "README.md"], ids=["guard.md", "README"])
def test_the_memory_table_in_the_docs_is_generated_and_fresh(page):
    assert memory_table() in page.read_text()


LORA_WITH_HEAD = LoraConfig(target_modules=["q_proj", "v_proj"], r=4, modules_to_save=["lm_head"])


@pytest.mark.parametrize("lora", [None, LORA_WITH_HEAD], ids=["full", "lora+head"])
def test_what_the_rule_reads_is_what_a_bf16_snapshot_holds(lora, toy_models, tmp_path):
    # The `memory.snapshot_fits` rule's figure, from the built trainer, against the bytes a real snapshot holds, for
    # a model loaded in bf16: a full fine-tune keeps bf16 weights and bf16 AdamW moments (6 bytes a parameter, not
    # the 10 of fp32 moments); LoRA keeps fp32 adapters (PEFT upcasts them) next to a bf16 copy of the head.
    model = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"], dtype=torch.bfloat16)
    peft = {"peft_config": lora} if lora is not None else {}
    trainer = build_trainer("dpo", model, tmp_path, max_steps=1, bf16=True, trainer_kwargs=peft)
    estimate = snapshot_facts(trainer)["snapshot_bytes_per_node"]
    trainer.train()
    trainer.nan_guard.take_snapshot()  # one with the moments (the last step is verified, not copied)
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    if lora is not None:
        assert {p.dtype for p in trainable} == {torch.float32, torch.bfloat16}  # a mixed layout
    held = trainer.nan_guard.snapshotter.held_bytes()
    assert held - estimate == 4 * len(trainable)  # AdamW's step counters, left out of the estimate
