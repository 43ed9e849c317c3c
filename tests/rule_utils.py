"""Helpers shared by the pure rule tests: real safe configs, `TrainerSetup`s built in memory, one engine stage, the
built-in rule ids in order, and a tiny KTO dataset."""

from __future__ import annotations

from datasets import Dataset

from safe_trainers import SafetyArguments
from safe_trainers.configs import config_class
from safe_trainers.kinds import get_kind
from safe_trainers.rules import DEFAULT_RULES
from safe_trainers.rules.context import Hardware, TrainerSetup
from safe_trainers.rules.stages import run_setup_rules
from safe_trainers.testing.toy import model_config

OUT = "safe-trainers-unused-output"  # configs are built, never trained: nothing is written here
CPU = Hardware(accelerator="cpu", bf16_supported=True)
CUDA_BF16 = Hardware(accelerator="cuda", bf16_supported=True)
CUDA_NO_BF16 = Hardware(accelerator="cuda", bf16_supported=False)

# The built-in rules, in the order they run (`rule_ids()`).
EXPECTED_IDS = [
    "peft.reward_seq_cls_lora",
    "precision.bf16_over_fp16",
    "attention.gemma2_no_flash",
    "optim.grad_clip",
    "logging.show_nonfinite",
    "grpo.group_size",
    "kto.batch_and_labels",
    "dpo.beta_positive",
    "data.no_loss_tokens",
    "precision.fp32_trainable_params",
    "precision.bf16_supported",
    "env.cublas_sigfpe",
    "optim.learning_rate",
    "tokens.reward_pad_token",
    "tokens.untrained_embeddings",
    "grpo.vocab_size",
    "grpo.vllm_is_truncation",
    "moe.router_aux_loss",
    "memory.snapshot_fits",
    "memory.save_copy_fits",
    "generation.ds3_gather",
]


def make_args(kind: str = "dpo", **overrides):
    """A real safe config of `kind` that is valid on this CPU-only machine."""
    kwargs = dict(output_dir=OUT, use_cpu=True, report_to="none")
    if get_kind(kind).online:
        kwargs.update(num_generations=2, per_device_train_batch_size=2)
    kwargs.update(overrides)
    return config_class(kind)(**kwargs)


def make_setup(kind="dpo", family="llama", *, hardware=CPU, model=None, args=None, config=None, **fields):
    """A `TrainerSetup` for a model path of `family` (no file needed: the config is built in memory)."""
    config = config if config is not None else (model_config(family) if family is not None else None)
    model = model if model is not None else f"toy/{family}"
    return TrainerSetup(
        kind=kind,
        args=args if args is not None else make_args(kind),
        model=model,
        model_config=config if isinstance(model, str) else model.config,
        hardware=hardware,
        **fields,
    )


def settings(mode="fix", disable=()):
    return SafetyArguments(safety_mode=mode, safety_disable_rules=list(disable))


def run_setup_stage(setup, mode="fix", disable=(), rules=None):
    return run_setup_rules(setup, settings(mode, disable), rules=rules if rules is not None else DEFAULT_RULES)


def change_map(finding):
    return {c.path: (c.old, c.new) for c in finding.changes}


def kto_data(labels):
    return Dataset.from_dict({"prompt": ["p"] * len(labels), "completion": ["c"] * len(labels), "label": labels})
