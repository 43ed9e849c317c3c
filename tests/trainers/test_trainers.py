"""Real construction and training of the six safe trainers on tiny models, on CPU.

Every test builds a real TRL trainer from a tiny model saved on disk (see `conftest.toy_models`), and trains for two
steps where training is part of the claim. Each rule is shown firing on the trainers it applies to, and staying quiet
where it should.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from safe_trainers import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    SafetyError,
)
from safe_trainers.kinds import KINDS, TRAINER_KINDS
from safe_trainers.rules import DEFAULT_RULES
from safe_trainers.testing.build import build_trainer, preset_args
from safe_trainers.testing.toy import dataset_for, rank_reward

from trainer_utils import (  # tests/ is on sys.path, as for conftest
    CONFIGS, DEFAULT_MODEL, TRAINERS, actions, changed, check_gemma2_sdpa_without_the_rule, read_report, snapshot,
    train_losses,
)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# Each trainer trains and changes the weights
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_trainer_trains_and_changes_weights(kind, toy_models, tmp_path):
    trainer = build_trainer(kind, toy_models[DEFAULT_MODEL[kind]], tmp_path)
    assert isinstance(trainer, getattr(trl, type(trainer).__name__))
    before = snapshot(trainer.model)
    losses = train_losses(trainer)
    assert all(math.isfinite(loss) for loss in losses)
    assert trainer.state.global_step == 2
    moved = changed(before, trainer.model)
    # every parameter of a tiny model gets a gradient in two steps
    assert sorted(moved) == sorted(before), set(before) - set(moved)
    assert trainer.safety_report.trainer == kind and trainer.safety_report.mode == "fix"


# --------------------------------------------------------------------------------------------------------------------
# precision.bf16_over_fp16
# --------------------------------------------------------------------------------------------------------------------


def test_dpo_fp16_on_gemma2_becomes_bf16(toy_models, tmp_path):
    args = DPOConfig(**preset_args("dpo", tmp_path / "out", fp16=True))
    trainer = DPOTrainer(model=toy_models["gemma2"], args=args, train_dataset=dataset_for("dpo", 8))
    assert trainer.args.bf16 is True and trainer.args.fp16 is False
    assert args.fp16 is True and args.bf16 is False  # the user's config object is untouched
    (finding,) = trainer.safety_report.by_rule("precision.bf16_over_fp16")
    assert finding.action == "fixed" and "`gemma2` activations overflow" in finding.message
    assert {(c.path, c.old, c.new) for c in finding.changes} >= {
        ("args.fp16", True, False),
        ("args.bf16", False, True),
    }
    assert trainer.accelerator.mixed_precision == "bf16"
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the `use_cpu` fix is for machines without an accelerator")
def test_fp16_on_cpu_without_use_cpu_sets_use_cpu(toy_models, tmp_path):
    trainer = build_trainer("kto", toy_models["qwen2"], tmp_path, fp16=True, use_cpu=False)
    assert (trainer.args.fp16, trainer.args.bf16, trainer.args.use_cpu) == (False, True, True)
    changes = {c.path: c.new for c in trainer.safety_report.changes}
    assert changes["args.use_cpu"] is True


def test_fp16_load_dtype_becomes_bf16_and_torch_dtype_is_renamed(toy_models, tmp_path):
    trainer = build_trainer("kto", toy_models["qwen2"], tmp_path, model_init_kwargs={"torch_dtype": "float16"})
    assert trainer.args.model_init_kwargs == {"dtype": "bfloat16"}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert actions(trainer)["precision.bf16_over_fp16"] == "fixed"


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_precision_rule_quiet_without_fp16(kind, toy_models, tmp_path):
    trainer = build_trainer(kind, toy_models[DEFAULT_MODEL[kind]], tmp_path, rows=4)
    assert "precision.bf16_over_fp16" not in actions(trainer)
    assert "precision.fp32_trainable_params" not in actions(trainer)
    assert trainer.args.fp16 is False
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}


# --------------------------------------------------------------------------------------------------------------------
# attention.gemma2_no_flash
# --------------------------------------------------------------------------------------------------------------------


def test_gemma2_path_with_sdpa_trains_with_eager(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["gemma2"], tmp_path, model_init_kwargs={"attn_implementation": "sdpa"})
    assert trainer.model.config._attn_implementation == "eager"
    assert trainer.args.model_init_kwargs == {"attn_implementation": "eager"}
    (finding,) = trainer.safety_report.by_rule("attention.gemma2_no_flash")
    assert finding.action == "fixed"
    assert [(c.path, c.old, c.new) for c in finding.changes] == [
        ("args.model_init_kwargs.attn_implementation", "sdpa", "eager")
    ]
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_gemma2_path_with_sdpa_without_the_rule(toy_models, tmp_path):
    check_gemma2_sdpa_without_the_rule("dpo", toy_models["gemma2"], tmp_path)


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
@pytest.mark.parametrize("current", ["sdpa", "flash_attention_2"])
def test_gemma2_instance_attention_replaced(kind, current, toy_models, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(toy_models["gemma2"])
    model.config._attn_implementation = current  # flash-attn is not installed: set what a loaded model would carry
    trainer = build_trainer(kind, model, tmp_path, rows=4)
    assert trainer.model.config._attn_implementation == "eager"
    (finding,) = trainer.safety_report.by_rule("attention.gemma2_no_flash")
    assert [(c.path, c.old, c.new) for c in finding.changes] == [("model.attn_implementation", current, "eager")]
    if kind == "dpo" and current == "flash_attention_2":
        assert "backward pass" in finding.message
        assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_gemma2_ref_model_attention_replaced(toy_models, tmp_path):
    ref = AutoModelForCausalLM.from_pretrained(toy_models["gemma2"])
    ref.config._attn_implementation = "flash_attention_2"
    trainer = build_trainer("dpo", toy_models["gemma2"], tmp_path, rows=4, trainer_kwargs={"ref_model": ref})
    assert ref.config._attn_implementation == "eager"
    (finding,) = trainer.safety_report.by_rule("attention.gemma2_no_flash")
    assert [c.path for c in finding.changes] == ["ref_model.attn_implementation"]


@pytest.mark.parametrize("as_instance", [False, True], ids=["path", "instance"])
def test_qwen2_sdpa_not_touched(as_instance, toy_models, tmp_path):
    if as_instance:
        model = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"], attn_implementation="sdpa")
        trainer = build_trainer("dpo", model, tmp_path, rows=4)
    else:
        trainer = build_trainer(
            "dpo", toy_models["qwen2"], tmp_path, rows=4, model_init_kwargs={"attn_implementation": "sdpa"}
        )
        assert trainer.args.model_init_kwargs == {"attn_implementation": "sdpa"}
    assert trainer.model.config._attn_implementation == "sdpa"
    assert "attention.gemma2_no_flash" not in actions(trainer)


# --------------------------------------------------------------------------------------------------------------------
# peft.reward_seq_cls_lora and precision.fp32_trainable_params
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_reward_lora_gets_seq_cls_trainable_head_and_saves_it(task_type, toy_models, tmp_path):
    peft_config = LoraConfig(task_type=task_type, target_modules=["q_proj", "v_proj"], r=4)
    trainer = build_trainer(
        "reward",
        toy_models["qwen2-rm"],
        tmp_path,
        model_init_kwargs={"dtype": "float16"},
        trainer_kwargs={"peft_config": peft_config},
    )
    assert trainer.model.peft_config["default"].task_type == "SEQ_CLS"
    assert peft_config.task_type == task_type  # the user's PEFT config is untouched
    head = {name: p.requires_grad for name, p in trainer.model.named_parameters() if "score" in name}
    assert any(head.values()), head
    fp16_trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    assert fp16_trainable == []
    assert trainer.args.model_init_kwargs == {"dtype": "auto"}
    (finding,) = trainer.safety_report.by_rule("peft.reward_seq_cls_lora")
    assert finding.action == "fixed" and f"`task_type={task_type!r}`" in finding.message
    # the LoRA rule chose dtype "auto" first, so the precision rule had nothing left to do
    assert "precision.bf16_over_fp16" not in actions(trainer)

    trained_head = [n for n, p in trainer.model.named_parameters() if "score" in n and p.requires_grad]
    before = snapshot(trainer.model)
    losses = train_losses(trainer)
    assert all(math.isfinite(loss) for loss in losses)
    assert set(trained_head) <= set(changed(before, trainer.model))

    trainer.save_model()
    with safe_open(os.path.join(trainer.args.output_dir, "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any("score" in key for key in keys), keys
    assert any("lora_A" in key for key in keys)


def test_reward_lora_head_stays_frozen_without_the_rule(toy_models, tmp_path):
    # the control: TRL alone leaves the random score head frozen with `task_type=None`
    trainer = build_trainer(
        "reward",
        toy_models["qwen2-rm"],
        tmp_path,
        rows=4,
        safety_disable_rules=["peft.reward_seq_cls_lora"],
        trainer_kwargs={"peft_config": LoraConfig(task_type=None, target_modules=["q_proj", "v_proj"], r=4)},
    )
    head = {name: p.requires_grad for name, p in trainer.model.named_parameters() if "score" in name}
    assert head and not any(head.values())
    assert actions(trainer)["peft.reward_seq_cls_lora"] == "skipped"


def test_reward_lora_seq_cls_fp32_not_touched(toy_models, tmp_path):
    trainer = build_trainer(
        "reward",
        toy_models["qwen2-rm"],
        tmp_path,
        rows=4,
        trainer_kwargs={"peft_config": LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"], r=4)},
    )
    assert "peft.reward_seq_cls_lora" not in actions(trainer)


def test_reward_lora_fp16_instance_head_upcast(toy_models, tmp_path):
    # with the precision rule off the fp16 weights stay; the reward rule still upcasts the trainable head
    model = AutoModelForSequenceClassification.from_pretrained(toy_models["qwen2-rm"], dtype=torch.float16)
    trainer = build_trainer(
        "reward",
        model,
        tmp_path,
        safety_disable_rules=["precision.bf16_over_fp16"],
        trainer_kwargs={"peft_config": LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"], r=4)},
    )
    (finding,) = trainer.safety_report.by_rule("peft.reward_seq_cls_lora")
    assert finding.action == "fixed" and "upcast to fp32" in finding.message
    assert any("score" in name for name in finding.data["names"])
    trainable = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and set(trainable.values()) == {torch.float32}
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_reward_peft_model_with_frozen_head_gets_a_trained_and_saved_head(toy_models, tmp_path):
    # TRL's own `test_train_peft_model`: a `PeftModel` made with a plain `LoraConfig()` (no task type), so the random
    # `score` head is frozen. It was refused; the fix is to train the head and save it with the adapter.
    model = AutoModelForSequenceClassification.from_pretrained(toy_models["qwen2-rm"])
    base_names = {f"base_model.model.{n}" for n, _ in model.named_parameters()}
    model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], r=4))
    trainer = build_trainer("reward", model, tmp_path, rows=4)
    (finding,) = trainer.safety_report.by_rule("peft.reward_seq_cls_lora")
    assert finding.action == "fixed" and "`score`" in finding.message
    assert [(c.path, c.old, c.new) for c in finding.changes] == [("model.peft_config.modules_to_save", None, ["score"])]
    head = {n: p.requires_grad for n, p in trainer.model.named_parameters() if "score" in n}
    assert any(head.values()), head

    before = snapshot(trainer.model)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))
    moved = set(changed(before, trainer.model))
    assert not moved & base_names  # the base model (its original head included) is untouched
    assert any("score.modules_to_save" in n for n in moved) and any("lora_B" in n for n in moved)
    trainer.save_model()
    with safe_open(os.path.join(trainer.args.output_dir, "adapter_model.safetensors"), "pt") as f:
        assert any("score" in key for key in f.keys())


def test_full_finetune_fp16_instance_is_upcast(toy_models, tmp_path):
    # with `precision.bf16_over_fp16` off the fp16 weights stay, and this rule upcasts the trainable ones
    model = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"], dtype=torch.float16)
    trainer = build_trainer("dpo", model, tmp_path, safety_disable_rules=["precision.bf16_over_fp16"])
    (finding,) = trainer.safety_report.by_rule("precision.fp32_trainable_params")
    assert finding.action == "fixed"
    assert len(finding.data["names"]) == len(list(trainer.model.parameters()))
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


# --------------------------------------------------------------------------------------------------------------------
# optim.grad_clip and logging.show_nonfinite
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_grad_clip_and_nonfinite_logging_fixed(kind, toy_models, tmp_path):
    trainer = build_trainer(kind, toy_models[DEFAULT_MODEL[kind]], tmp_path, rows=4, max_grad_norm=0.0)
    assert trainer.args.max_grad_norm == 1.0
    assert trainer.args.logging_nan_inf_filter is False
    assert actions(trainer)["optim.grad_clip"] == "fixed"
    assert actions(trainer)["logging.show_nonfinite"] == "fixed"


@pytest.mark.parametrize("kind", ["reward", "grpo"])
def test_grad_clip_and_nonfinite_logging_quiet_when_set(kind, toy_models, tmp_path):
    trainer = build_trainer(
        kind, toy_models[DEFAULT_MODEL[kind]], tmp_path, rows=4, max_grad_norm=0.5, logging_nan_inf_filter=False
    )
    assert trainer.args.max_grad_norm == 0.5
    assert trainer.safety_report.findings == []
    assert trainer.safety_report.render().endswith("all safety rules passed, nothing changed.")


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
    assert lines[0] == f"safe_trainers (reward): {count} safety rules run, none fired; NaN guard on; report in {path}."
    assert int(count) == sum("reward" in r.trainers for r in DEFAULT_RULES)
    caplog.clear()
    with caplog.at_level("WARNING", logger="safe_trainers"):
        trainer = build_trainer("reward", toy_models["qwen2-rm"], tmp_path / "b", nan_guard=False,
                                safety_disable_rules=["optim.grad_clip"], **settings)  # fmt: skip
    [line] = [r.getMessage() for r in caplog.records if r.name == "safe_trainers"]
    assert f"{int(count) - 1} safety rules run, none fired (1 disabled: `optim.grad_clip`)" in line
    assert "; NaN guard off (`nan_guard=False`); " in line


def test_grad_clip_fix_takes_effect_in_training(toy_models, tmp_path):
    trainer = build_trainer("reward", toy_models["qwen2-rm"], tmp_path, max_grad_norm=0.0, learning_rate=1e-6)
    trainer.create_optimizer()
    inner = trainer.optimizer
    original_step = inner.step
    seen = []

    def step(*args, **kwargs):  # the real step, recording the norm of the gradients the optimizer receives
        grads = [p.grad.norm() for group in inner.param_groups for p in group["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack(grads))))
        return original_step(*args, **kwargs)

    inner.step = step
    train_losses(trainer)
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(seen) == 2
    assert max(logged) > 1.0, logged  # the gradients needed clipping (the logged norm is taken before clipping)
    assert all(norm <= 1.0 + 1e-4 for norm in seen), seen


# --------------------------------------------------------------------------------------------------------------------
# grpo.group_size: checked before any weight is loaded
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def config_only_model(toy_models, tmp_path):
    """A model directory with only a valid `config.json`: loading weights from it raises OSError."""
    path = tmp_path / "config-only"
    path.mkdir()
    shutil.copy(os.path.join(toy_models["qwen2"], "config.json"), path / "config.json")
    return str(path)


def test_config_only_model_cannot_be_loaded(config_only_model, tmp_path):
    # the control for the two tests below: TRL itself fails on this directory when loading weights
    args = trl.GRPOConfig(**preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4))
    with pytest.raises(OSError):
        trl.GRPOTrainer(
            model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4)
        )


def test_grpo_group_not_dividing_batch_refused_before_loading(config_only_model, tmp_path):
    args = GRPOConfig(**preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4, num_generations=2))
    args.num_generations = 3  # mutated after the config validated itself
    with pytest.raises(
        SafetyError, match=r"\[grpo.group_size\] `generation_batch_size=4`.*`num_generations=3`"
    ) as exc:
        GRPOTrainer(model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4))
    assert [f.rule_id for f in exc.value.findings] == ["grpo.group_size"]
    assert not os.path.exists(args.output_dir)  # nothing was written for a refused configuration


def test_grpo_zero_temperature_refused_before_loading(config_only_model, tmp_path):
    args = GRPOConfig(**preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4))
    args.temperature = 0.0
    with pytest.raises(SafetyError, match=r"\[grpo.group_size\] `temperature=0.0`"):
        GRPOTrainer(model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4))


def test_grpo_config_refuses_bad_groups_up_front(tmp_path):
    with pytest.raises(SafetyError, match="`num_generations=1`"):
        GRPOConfig(**preset_args("grpo", tmp_path / "out", num_generations=1))
    with pytest.raises(SafetyError, match="`temperature=0`"):
        GRPOConfig(**preset_args("grpo", tmp_path / "out", temperature=0))


def test_grpo_group_rule_disabled_is_left_to_trl(toy_models, tmp_path):
    args = GRPOConfig(
        **preset_args(
            "grpo", tmp_path / "out", per_device_train_batch_size=4, safety_disable_rules=["grpo.group_size"]
        )
    )
    args.temperature = 0.0
    trainer = GRPOTrainer(
        model=toy_models["qwen2"], reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4)
    )
    assert trainer.args.temperature == 0.0
    assert actions(trainer)["grpo.group_size"] == "skipped"


# --------------------------------------------------------------------------------------------------------------------
# kto.batch_and_labels and dpo.beta_positive
# --------------------------------------------------------------------------------------------------------------------


def test_kto_batch_of_one_refused(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\[kto.batch_and_labels\] `per_device_train_batch_size=1`"):
        build_trainer("kto", toy_models["qwen2"], tmp_path, per_device_train_batch_size=1)


@pytest.mark.parametrize("label", [True, False])
def test_kto_single_label_dataset_trains(label, toy_models, tmp_path):
    # only desirable (or only undesirable) examples: TRL skips the empty side and averages with `nanmean`
    data = dataset_for("kto", 8).map(lambda row: {"label": label})
    trainer = build_trainer("kto", toy_models["qwen2"], tmp_path, dataset=data, learning_rate=1e-6)
    assert "kto.batch_and_labels" not in actions(trainer)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_kto_apo_zero_unpaired_batch_of_one_trains(toy_models, tmp_path):
    # no KL term, so nothing needs two examples per micro-batch
    trainer = build_trainer(
        "kto", toy_models["qwen2"], tmp_path, per_device_train_batch_size=1, loss_type="apo_zero_unpaired"
    )
    assert "kto.batch_and_labels" not in actions(trainer)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_kto_batch_and_beta_reported_together(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\(2 problems\)") as exc:
        build_trainer("kto", toy_models["qwen2"], tmp_path, per_device_train_batch_size=1, beta=math.inf)
    assert [f.rule_id for f in exc.value.findings] == ["kto.batch_and_labels", "dpo.beta_positive"]
    assert "`per_device_train_batch_size=1`" in str(exc.value) and "`beta=inf`" in str(exc.value)


def test_dpo_beta_zero_with_ipo_refused(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\[dpo.beta_positive\] `beta=0.0` with `loss_type='ipo'`"):
        build_trainer("dpo", toy_models["qwen2"], tmp_path, beta=0.0, loss_type="ipo")


def test_dpo_beta_zero_with_ipo_crashes_in_trl(toy_models, tmp_path):
    # the control for the refusal above: TRL itself fails with a division by zero on the first step
    trainer = trl.DPOTrainer(
        model=toy_models["qwen2"],
        args=trl.DPOConfig(**preset_args("dpo", tmp_path / "out", beta=0.0, loss_type="ipo")),
        train_dataset=dataset_for("dpo", 4),
    )
    with pytest.raises(ZeroDivisionError):
        trainer.train()


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_beta_zero_warned_and_trains(kind, toy_models, tmp_path):
    trainer = build_trainer(kind, toy_models["qwen2"], tmp_path, beta=0.0)
    assert actions(trainer)["dpo.beta_positive"] == "warned"
    assert trainer.args.beta == 0.0
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_beta_zero_accepted_by_trl(kind, toy_models, tmp_path):
    # the control: TRL itself builds a trainer with beta=0 (no gradient from the preference loss)
    trl_config = {"dpo": trl.DPOConfig, "kto": trl.KTOConfig}[kind]
    trl_trainer = {"dpo": trl.DPOTrainer, "kto": trl.KTOTrainer}[kind]
    args = trl_config(**preset_args(kind, tmp_path / "out", beta=0.0))
    trainer = trl_trainer(model=toy_models["qwen2"], args=args, train_dataset=dataset_for(kind, 4))
    assert trainer.args.beta == 0.0


# --------------------------------------------------------------------------------------------------------------------
# data.no_loss_tokens
# --------------------------------------------------------------------------------------------------------------------


def _pretokenized_reward_rows(n=8, empty_chosen=(), empty_rejected=()):
    rows = [{"chosen_ids": [5, 6, 7, 1], "rejected_ids": [5, 8, 9, 1]} for _ in range(n)]
    for i in empty_chosen:
        rows[i]["chosen_ids"] = []
    for i in empty_rejected:
        rows[i]["rejected_ids"] = []
    return Dataset.from_list(rows)


def test_reward_rows_without_tokens_dropped_and_counted(toy_models, tmp_path):
    data = _pretokenized_reward_rows(8, empty_chosen=(1, 4), empty_rejected=(6,))
    trainer = build_trainer("reward", toy_models["qwen2-rm"], tmp_path, dataset=data)
    assert len(trainer.train_dataset) == 5
    assert all(len(row["chosen_ids"]) and len(row["rejected_ids"]) for row in trainer.train_dataset)
    (finding,) = trainer.safety_report.by_rule("data.no_loss_tokens")
    assert finding.action == "fixed" and "3 of 8 training examples" in finding.message
    assert [(c.path, c.old, c.new) for c in finding.changes] == [("train_dataset.num_rows", 8, 5)]
    saved = [f for f in read_report(trainer)["findings"] if f["rule_id"] == "data.no_loss_tokens"]
    assert saved[0]["changes"] == [{"path": "train_dataset.num_rows", "old": 8, "new": 5}]
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_reward_all_rows_without_tokens_refused(toy_models, tmp_path):
    data = _pretokenized_reward_rows(4, empty_chosen=(0, 1, 2, 3))
    with pytest.raises(SafetyError, match=r"\[data.no_loss_tokens\] all 4 training examples have no completion token"):
        build_trainer("reward", toy_models["qwen2-rm"], tmp_path, dataset=data)


def _dpo_with_long_prompts(n=8, long=(0, 1, 2)):
    rows = dataset_for("dpo", n).to_list()
    for i in long:
        rows[i]["prompt"] = " ".join(["one two three four five six seven eight nine ten"] * 4)
    return Dataset.from_list(rows)


def test_dpo_prompts_filling_max_length_rows_dropped_and_training_runs(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, dataset=_dpo_with_long_prompts(), max_length=16)
    assert len(trainer.train_dataset) == 5
    assert all(len(row["prompt_ids"]) < 16 for row in trainer.train_dataset)
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_dpo_prompts_filling_max_length_counted_in_report(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, dataset=_dpo_with_long_prompts(), max_length=16)
    assert len(trainer.train_dataset) == 5  # three rows were dropped ...
    findings = trainer.safety_report.by_rule("data.no_loss_tokens")
    assert findings, "... but the report does not say so"
    assert "3 of 8 training examples" in findings[0].message


def test_dpo_all_prompts_filling_max_length_refused(toy_models, tmp_path):
    data = _dpo_with_long_prompts(4, long=(0, 1, 2, 3))
    with pytest.raises(SafetyError, match=r"\[data.no_loss_tokens\] all 4 training examples"):
        build_trainer("dpo", toy_models["qwen2"], tmp_path, dataset=data, max_length=16)


def test_dpo_keep_end_keeps_long_prompts(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo",
        toy_models["qwen2"],
        tmp_path,
        dataset=_dpo_with_long_prompts(),
        max_length=16,
        truncation_mode="keep_end",
    )
    assert len(trainer.train_dataset) == 8
    assert "data.no_loss_tokens" not in actions(trainer)


# --------------------------------------------------------------------------------------------------------------------
# Modes, disabled rules, report file, plain TRL configs, args=None
# --------------------------------------------------------------------------------------------------------------------


def _unsafe_gemma_config(tmp_path, **overrides):
    return preset_args(
        "dpo",
        tmp_path / "out",
        fp16=True,
        max_grad_norm=0.0,
        model_init_kwargs={"attn_implementation": "sdpa"},
        **overrides,
    )


def test_strict_mode_raises_one_error_with_every_finding(toy_models, tmp_path):
    args = DPOConfig(**_unsafe_gemma_config(tmp_path, safety_mode="strict"))
    with pytest.raises(SafetyError, match=r"refused this configuration \(3 problems\)") as exc:
        DPOTrainer(model=toy_models["gemma2"], args=args, train_dataset=dataset_for("dpo", 4))
    # TRL's default `logging_nan_inf_filter=True` is not a problem of this config: it does not fail `strict`.
    expected = ["precision.bf16_over_fp16", "attention.gemma2_no_flash", "optim.grad_clip"]
    assert [f.rule_id for f in exc.value.findings] == expected
    for rule_id in expected:
        assert f"[{rule_id}]" in str(exc.value)
    assert not os.path.exists(args.output_dir)


def test_strict_mode_passes_a_safe_config(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, rows=4, safety_mode="strict", logging_nan_inf_filter=False
    )
    assert trainer.safety_report.findings == [] and trainer.safety_report.mode == "strict"


def test_fix_mode_applies_everything_and_writes_the_report(toy_models, tmp_path):
    args = DPOConfig(**_unsafe_gemma_config(tmp_path))
    trainer = DPOTrainer(model=toy_models["gemma2"], args=args, train_dataset=dataset_for("dpo", 8))
    a = trainer.args
    assert (a.fp16, a.bf16, a.max_grad_norm, a.logging_nan_inf_filter) == (False, True, 1.0, False)
    assert trainer.model.config._attn_implementation == "eager"
    assert (args.fp16, args.max_grad_norm, args.model_init_kwargs) == (True, 0.0, {"attn_implementation": "sdpa"})
    data = read_report(trainer)
    assert data["trainer"] == "dpo" and data["mode"] == "fix"
    assert [(f["rule_id"], f["action"]) for f in data["findings"]] == [
        ("precision.bf16_over_fp16", "fixed"),
        ("attention.gemma2_no_flash", "fixed"),
        ("optim.grad_clip", "fixed"),
        ("logging.show_nonfinite", "fixed"),
    ]
    clip = data["findings"][2]
    assert clip["changes"] == [{"path": "args.max_grad_norm", "old": 0.0, "new": 1.0}]
    assert data == trainer.safety_report.to_dict()


def test_warn_mode_changes_nothing(toy_models, tmp_path):
    args = DPOConfig(**preset_args("dpo", tmp_path / "out", fp16=True, max_grad_norm=0.0, safety_mode="warn"))
    trainer = DPOTrainer(model=toy_models["gemma2"], args=args, train_dataset=dataset_for("dpo", 4))
    a = trainer.args
    assert a is args
    assert (a.fp16, a.bf16, a.max_grad_norm, a.logging_nan_inf_filter) == (True, False, 0.0, True)
    assert actions(trainer) == {
        "precision.bf16_over_fp16": "warned",
        "optim.grad_clip": "warned",
        "logging.show_nonfinite": "warned",
    }
    assert trainer.safety_report.changes == []
    assert {f["action"] for f in read_report(trainer)["findings"]} == {"warned"}


def test_warn_mode_still_refuses_blocked_findings(toy_models, tmp_path):
    with pytest.raises(SafetyError, match=r"\[dpo.beta_positive\]"):
        build_trainer("dpo", toy_models["qwen2"], tmp_path, beta=0.0, loss_type="ipo", safety_mode="warn")


def test_off_mode_runs_no_rule(toy_models, tmp_path):
    trainer = build_trainer("kto", toy_models["qwen2"], tmp_path, rows=4, max_grad_norm=0.0, safety_mode="off")
    assert trainer.args.max_grad_norm == 0.0 and trainer.args.logging_nan_inf_filter is True
    assert trainer.safety_report.findings == []
    assert read_report(trainer) == {"trainer": "kto", "mode": "off", "findings": []}
    assert "safety rules are off" in trainer.safety_report.render()


def test_off_mode_lets_trl_see_blocked_settings(toy_models, tmp_path):
    trainer = build_trainer("dpo", toy_models["qwen2"], tmp_path, rows=4, beta=0.0, safety_mode="off")
    assert trainer.args.beta == 0.0


def test_disabled_rules_left_alone(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo",
        toy_models["gemma2"],
        tmp_path,
        rows=4,
        fp16=True,
        max_grad_norm=0.0,
        safety_disable_rules=["optim.grad_clip", "precision.bf16_over_fp16"],
    )
    assert trainer.args.max_grad_norm == 0.0 and trainer.args.fp16 is True
    assert trainer.args.logging_nan_inf_filter is False  # the other rules still run
    assert actions(trainer) == {
        "precision.bf16_over_fp16": "skipped",
        "optim.grad_clip": "skipped",
        "logging.show_nonfinite": "fixed",
    }
    skipped = [f for f in read_report(trainer)["findings"] if f["action"] == "skipped"]
    assert {f["rule_id"] for f in skipped} == {"optim.grad_clip", "precision.bf16_over_fp16"}


def test_plain_trl_config_gets_default_safety(toy_models, tmp_path):
    args = trl.DPOConfig(**preset_args("dpo", tmp_path / "out", max_grad_norm=0.0))
    trainer = DPOTrainer(model=toy_models["qwen2"], args=args, train_dataset=dataset_for("dpo", 8))
    assert type(trainer.args) is trl.DPOConfig
    assert trainer.args.max_grad_norm == 1.0 and args.max_grad_norm == 0.0
    assert trainer.safety_report.mode == "fix"
    assert trainer.safety_settings.safety_disable_rules == []
    assert os.path.isfile(os.path.join(args.output_dir, "safety_report.json"))
    assert all(math.isfinite(loss) for loss in train_losses(trainer))


def test_plain_trl_grpo_config_is_checked(config_only_model, tmp_path):
    args = trl.GRPOConfig(**preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4))
    args.num_generations = 1
    with pytest.raises(SafetyError, match="`num_generations=1`"):
        GRPOTrainer(model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4))


def test_plain_trl_grpo_config_checked_when_no_other_fix_applies(config_only_model, tmp_path):
    # the same mutated config as above, but with nothing for an earlier rule to fix: grpo.group_size speaks
    args = trl.GRPOConfig(
        **preset_args("grpo", tmp_path / "out", per_device_train_batch_size=4, logging_nan_inf_filter=False)
    )
    args.num_generations = 1
    with pytest.raises(SafetyError, match="`num_generations=1`"):
        GRPOTrainer(model=config_only_model, reward_funcs=rank_reward, args=args, train_dataset=dataset_for("grpo", 4))


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_args_none_raises_what_trl_raises(kind, toy_models, tmp_path, monkeypatch):
    # With no config, TRL builds a default one (bf16=True); transformers refuses bf16 on a CPU-only machine
    # without `use_cpu`. Whatever TRL raises here, the safe trainer must raise the same.
    monkeypatch.chdir(tmp_path)
    extra = {"reward_funcs": rank_reward} if KINDS[kind].online else {}
    model = toy_models[DEFAULT_MODEL[kind]]
    trl_class = getattr(trl, TRAINERS[kind].__name__)
    try:
        trl_class(model, train_dataset=dataset_for(kind, 4), **extra)
    except Exception as e:  # noqa: BLE001 - we compare with whatever TRL does
        expected = e
    else:
        pytest.skip("this machine accepts TRL's default config; covered by the next test")
    with pytest.raises(type(expected)) as exc:
        TRAINERS[kind](model, train_dataset=dataset_for(kind, 4), **extra)
    assert type(exc.value) is type(expected) and str(exc.value) == str(expected)


@pytest.mark.parametrize("kind, suffix", [("dpo", "DPO"), ("reward", "Reward"), ("sft", "SFT")])
def test_args_none_default_config_named_after_model(kind, suffix, toy_models, tmp_path, monkeypatch):
    # pretend bf16 is available so that the default config can be built on this CPU-only machine
    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    model = toy_models[DEFAULT_MODEL[kind]]
    trl_trainer = getattr(trl, TRAINERS[kind].__name__)(model, train_dataset=dataset_for(kind, 4))
    trainer = TRAINERS[kind](model, train_dataset=dataset_for(kind, 4))
    expected_dir = f"{os.path.basename(model)}-{suffix}"
    assert trl_trainer.args.output_dir == trainer.args.output_dir == expected_dir
    assert isinstance(trainer.args, CONFIGS[kind])
    assert trainer.args.bf16 == trl_trainer.args.bf16
    assert os.path.isfile(tmp_path / expected_dir / "safety_report.json")
