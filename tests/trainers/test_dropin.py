"""Drop-in parity with TRL: same classes, same signatures, same config fields and CLI, same errors, same training.

The second half ports the behaviours that TRL's own trainer tests check (training moves the weights, PEFT trains only
the adapter, an eval dataset is evaluated, a reference model stays frozen, ...) to the safe trainers, with tiny local
models on CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import math
import subprocess
import sys

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import safe_trainers
from safe_trainers import SafetyArguments, SafetyError
from safe_trainers.kinds import KINDS as KIND_ROWS
from safe_trainers.kinds import TRAINER_KINDS
from safe_trainers.testing.build import preset_args
from safe_trainers.testing.toy import count_words_reward, dataset_for, rank_reward

KINDS = TRAINER_KINDS
DEFAULT_MODEL = {k.id: "qwen2-rm" if k.model_task == "seq_cls" else "qwen2" for k in KIND_ROWS.values()}
SAFETY_FIELDS = [f.name for f in dataclasses.fields(SafetyArguments)]


def trainer_classes(kind):
    name = KIND_ROWS[kind].trainer_name
    return getattr(safe_trainers, name), getattr(trl, name)


def config_classes(kind):
    name = KIND_ROWS[kind].config_name
    return getattr(safe_trainers, name), getattr(trl, name)


def length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c)) for c in completions]


def config_kwargs(kind, tmp_path, name="out", **overrides):
    """The `"quick"` preset's settings; the trainers are built by hand here, as the signatures are what is tested."""
    # `logging_nan_inf_filter=False`: the safe trainers would otherwise fix it, and these tests compare with TRL
    return preset_args(kind, tmp_path / name, logging_nan_inf_filter=False, **overrides)


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def losses(trainer):
    trainer.train()
    values = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert values and all(math.isfinite(v) for v in values), trainer.state.log_history
    return values


# --------------------------------------------------------------------------------------------------------------------
# Classes and signatures
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_safe_classes_subclass_trl_classes(kind):
    safe_trainer, trl_trainer = trainer_classes(kind)
    safe_config, trl_config = config_classes(kind)
    assert issubclass(safe_trainer, trl_trainer) and safe_trainer.__name__ == trl_trainer.__name__
    assert issubclass(safe_config, trl_config) and safe_config.__name__ == trl_config.__name__
    assert issubclass(safe_config, SafetyArguments)
    assert safe_trainer._trl_class is trl_trainer and safe_trainer._safety_config_class is safe_config


def _parameters(function):
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_init_signature_matches_trl(kind):
    safe_trainer, trl_trainer = trainer_classes(kind)
    assert _parameters(safe_trainer.__init__) == _parameters(trl_trainer.__init__)


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_accepts_exactly_trl_arguments(kind):
    # what the constructor *binds* is TRL's signature, whatever `inspect` shows
    safe_trainer, trl_trainer = trainer_classes(kind)
    required = ("model", rank_reward) if KIND_ROWS[kind].online else ("model",)  # RLOO requires `reward_funcs`
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        safe_trainer(*required, bogus=1)
    with pytest.raises(TypeError, match="model"):
        safe_trainer()
    n_positional = len(_parameters(trl_trainer.__init__))  # self + every parameter
    with pytest.raises(TypeError):
        safe_trainer(*(["model"] + [None] * n_positional))


@pytest.mark.parametrize("kind", KINDS)
def test_config_fields_are_trl_fields_plus_safety_fields(kind):
    safe_config, trl_config = config_classes(kind)
    safe_fields = {f.name: f for f in dataclasses.fields(safe_config)}
    trl_fields = {f.name: f for f in dataclasses.fields(trl_config)}
    # TRL's fields first, in TRL's order (positional construction keeps working), then the safety fields
    assert list(safe_fields) == list(trl_fields) + SAFETY_FIELDS
    for name, trl_field in trl_fields.items():
        safe_field = safe_fields[name]
        assert safe_field.default == trl_field.default, name
        assert safe_field.default_factory == trl_field.default_factory, name
        assert safe_field.init == trl_field.init, name
        assert safe_field.metadata.get("help") == trl_field.metadata.get("help"), name


@pytest.mark.parametrize("kind", KINDS)
def test_config_values_equal_trl_values(kind, tmp_path):
    safe_config, trl_config = config_classes(kind)
    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, learning_rate=3e-4, max_grad_norm=0.5)
    if KIND_ROWS[kind].online:
        kwargs.update(num_generations=4, per_device_train_batch_size=4)
    safe = safe_config(**kwargs)
    plain = trl_config(**kwargs)
    safe_dict = safe.to_dict()
    assert {k: safe_dict.pop(k) for k in SAFETY_FIELDS} == {
        "safety_mode": "fix",
        "safety_disable_rules": [],
        "nan_guard": True,
        "nan_snapshot_steps": None,
        "nan_snapshot_budget": 0.01,
        "nan_rollback_from": "memory",
        "nan_max_rollbacks": 3,
        "nan_max_consecutive_skips": 3,
        "nan_lr_backoff": 0.5,
        "nan_spike_factor": 0.0,
        "nan_spike_window": 64,
        "nan_spike_warmup": 16,
        "nan_spike_patience": None,
        "nan_replay_max_bytes": 64 * 2**20,
        "nan_replay_limit": 5,
        "resume_on_restart": True,
        "skip_step_after_crashes": 2,
        "trusted_checkpoint_globals": [],
        "preempt_signals": ["SIGTERM", "SIGUSR1"],
        "hang_timeout": 900.0,
        "hang_timeout_factor": 10.0,
        "hang_action": "auto",
        "job_end_time": None,
        "job_end_slack": 60.0,
        "event_alert_interval": 600.0,
        "save_in_background": True,
        "collapse_signals": ["entropy", "kl", "completion_length"],
        "collapse_window": 32,
        "collapse_patience": 3,
    }
    assert safe_dict == plain.to_dict()


def test_grpo_config_derived_batch_not_divisible_is_a_value_error(tmp_path):
    # TRL derives the generation batch while validating; the rule answers with its own message, and TRL's
    # ValueError stays attached as the cause (code that catches ValueError still works).
    with pytest.raises(ValueError, match=r"`generation_batch_size=4`.*`num_generations=3`") as error:
        safe_trainers.GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, num_generations=3, per_device_train_batch_size=4
        )
    assert isinstance(error.value, safe_trainers.SafetyError)
    assert "generation_batch_size (4)" in str(error.value.__cause__)


def test_config_positional_output_dir():
    assert safe_trainers.DPOConfig("somewhere", use_cpu=True).output_dir == "somewhere"


# --------------------------------------------------------------------------------------------------------------------
# CLI and YAML through TRL's parser
# --------------------------------------------------------------------------------------------------------------------

CLI = [
    "--safety_mode",
    "strict",
    "--safety_disable_rules",
    "optim.grad_clip",
    "logging.show_nonfinite",
    "--nan_guard",
    "false",
]


@pytest.mark.parametrize("kind", KINDS)
def test_trl_parser_cli_flags(kind, tmp_path):
    safe_config, _ = config_classes(kind)
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--learning_rate", "2e-5", *CLI]
    if KIND_ROWS[kind].online:
        argv += ["--num_generations", "2", "--per_device_train_batch_size", "2"]
    (config,) = trl.TrlParser((safe_config,)).parse_args_and_config(argv)
    assert type(config) is safe_config
    assert config.safety_mode == "strict"
    assert config.safety_disable_rules == ["optim.grad_clip", "logging.show_nonfinite"]
    assert config.nan_guard is False
    assert config.learning_rate == 2e-5 and config.use_cpu is True


def test_trl_parser_yaml_config_and_cli_override(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        f"output_dir: {tmp_path / 'out'}\n"
        "use_cpu: true\n"
        "beta: 0.2\n"
        "safety_mode: warn\n"
        "safety_disable_rules:\n"
        "  - optim.grad_clip\n"
        "  - precision.bf16_over_fp16\n"
        "nan_guard: false\n"
        "nan_snapshot_steps: 5\n"
    )
    parser = trl.TrlParser((trl.ScriptArguments, safe_trainers.DPOConfig, trl.ModelConfig))
    script, config, model = parser.parse_args_and_config(["--config", str(path), "--dataset_name", "toy"])
    assert script.dataset_name == "toy"
    assert type(config) is safe_trainers.DPOConfig
    assert (config.beta, config.safety_mode, config.nan_guard, config.nan_snapshot_steps) == (0.2, "warn", False, 5)
    assert config.safety_disable_rules == ["optim.grad_clip", "precision.bf16_over_fp16"]
    # a CLI flag wins over the YAML file, as for every TRL field
    _, config, _ = parser.parse_args_and_config(
        ["--config", str(path), "--dataset_name", "toy", "--safety_mode", "off", "--beta", "0.3"]
    )
    assert (config.safety_mode, config.beta) == ("off", 0.3)


def test_trl_parser_rejects_bad_safety_values(tmp_path, capsys):
    parser = trl.TrlParser((safe_trainers.KTOConfig,))
    base = ["--output_dir", str(tmp_path), "--use_cpu", "true"]
    with pytest.raises(SystemExit):
        parser.parse_args_and_config(base + ["--safety_mode", "loud"])
    assert "invalid choice: 'loud'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown rule ids \['nope'\]\. Valid ids are: "):
        parser.parse_args_and_config(base + ["--safety_disable_rules", "nope"])


def test_trl_parser_grpo_group_check(tmp_path):
    parser = trl.TrlParser((safe_trainers.GRPOConfig,))
    with pytest.raises(SafetyError, match="`num_generations=1`"):
        parser.parse_args_and_config(["--output_dir", str(tmp_path), "--use_cpu", "true", "--num_generations", "1"])


# --------------------------------------------------------------------------------------------------------------------
# Calling conventions and errors
# --------------------------------------------------------------------------------------------------------------------


def test_positional_call_works_like_keywords(toy_models, tmp_path):
    args = safe_trainers.DPOConfig(**config_kwargs("dpo", tmp_path, "pos", max_grad_norm=0.0))
    data = dataset_for("dpo", 8)
    positional = safe_trainers.DPOTrainer(toy_models["qwen2"], None, args, None, data)
    keyword = safe_trainers.DPOTrainer(model=toy_models["qwen2"], args=args, train_dataset=data)
    for trainer in (positional, keyword):
        assert trainer.args.max_grad_norm == 1.0  # the fixed config replaced the positional one too
        assert len(trainer.train_dataset) == 8
    assert positional.safety_report.to_dict() == keyword.safety_report.to_dict()
    assert losses(positional) == losses(keyword)


def test_positional_call_grpo_and_reward(toy_models, tmp_path):
    grpo_args = safe_trainers.GRPOConfig(**config_kwargs("grpo", tmp_path, "g", max_grad_norm=0.0))
    trainer = safe_trainers.GRPOTrainer(toy_models["qwen2"], rank_reward, grpo_args, dataset_for("grpo", 4))
    assert trainer.args.max_grad_norm == 1.0 and trainer.reward_funcs == [rank_reward]
    reward_args = safe_trainers.RewardConfig(**config_kwargs("reward", tmp_path, "r", max_grad_norm=0.0))
    trainer = safe_trainers.RewardTrainer(toy_models["qwen2-rm"], reward_args, None, dataset_for("reward", 4))
    assert trainer.args.max_grad_norm == 1.0 and len(trainer.train_dataset) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_missing_train_dataset_keeps_trl_error(kind, toy_models, tmp_path):
    safe_trainer, trl_trainer = trainer_classes(kind)
    safe_config, trl_config = config_classes(kind)
    extra = {"reward_funcs": rank_reward} if KIND_ROWS[kind].online else {}
    model = toy_models[DEFAULT_MODEL[kind]]
    with pytest.raises(ValueError) as expected:
        trl_trainer(model, args=trl_config(**config_kwargs(kind, tmp_path)), **extra)
    assert "`train_dataset` is required" in str(expected.value)
    with pytest.raises(ValueError, match="`train_dataset` is required") as got:
        safe_trainer(model, args=safe_config(**config_kwargs(kind, tmp_path)), **extra)
    assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)


@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_missing_model_dir_keeps_trl_error(kind, tmp_path):
    safe_trainer, trl_trainer = trainer_classes(kind)
    safe_config, trl_config = config_classes(kind)
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(Exception) as expected:
        trl_trainer(missing, args=trl_config(**config_kwargs(kind, tmp_path)), train_dataset=dataset_for(kind, 2))
    with pytest.raises(type(expected.value)) as got:
        safe_trainer(missing, args=safe_config(**config_kwargs(kind, tmp_path)), train_dataset=dataset_for(kind, 2))
    assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)


def test_safety_error_caught_as_value_error(toy_models, tmp_path):
    args = safe_trainers.KTOConfig(**config_kwargs("kto", tmp_path, per_device_train_batch_size=1))
    try:
        safe_trainers.KTOTrainer(toy_models["qwen2"], args=args, train_dataset=dataset_for("kto", 4))
    except ValueError as e:  # code written for TRL catches configuration errors as ValueError
        assert isinstance(e, SafetyError) and "per_device_train_batch_size=1" in str(e)
    else:
        pytest.fail("a batch of 1 must be refused for KTO")


# --------------------------------------------------------------------------------------------------------------------
# Same numbers as TRL
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_same_training_losses_as_trl(kind, toy_models, tmp_path):
    safe_trainer, trl_trainer = trainer_classes(kind)
    safe_config, trl_config = config_classes(kind)
    extra = {"reward_funcs": rank_reward} if KIND_ROWS[kind].online else {}
    model = toy_models[DEFAULT_MODEL[kind]]
    # each trainer seeds the global RNG when it is built, so build and train one before the other
    ours = safe_trainer(
        model, args=safe_config(**config_kwargs(kind, tmp_path, "safe")), train_dataset=dataset_for(kind, 8), **extra
    )
    assert ours.safety_report.findings == []  # a safe config: nothing changed, so the run must be TRL's run
    our_losses = losses(ours)
    theirs = trl_trainer(
        model, args=trl_config(**config_kwargs(kind, tmp_path, "trl")), train_dataset=dataset_for(kind, 8), **extra
    )
    assert our_losses == pytest.approx(losses(theirs), rel=1e-6, abs=1e-7)
    for (name, a), (_, b) in zip(ours.model.named_parameters(), theirs.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


# --------------------------------------------------------------------------------------------------------------------
# Behaviours from TRL's own trainer tests
# --------------------------------------------------------------------------------------------------------------------


def _lora(task_type):
    return LoraConfig(task_type=task_type, target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8)


@pytest.mark.parametrize("kind", KINDS)
def test_train_with_peft_moves_only_the_adapter(kind, toy_models, tmp_path):
    safe_trainer, _ = trainer_classes(kind)
    safe_config, _ = config_classes(kind)
    extra = {"reward_funcs": rank_reward} if KIND_ROWS[kind].online else {}
    task_type = "SEQ_CLS" if kind == "reward" else "CAUSAL_LM"
    trainer = safe_trainer(
        toy_models[DEFAULT_MODEL[kind]],
        args=safe_config(**config_kwargs(kind, tmp_path)),
        train_dataset=dataset_for(kind, 8),
        peft_config=_lora(task_type),
        **extra,
    )
    assert isinstance(trainer.model, PeftModel)
    before = snapshot(trainer.model)
    losses(trainer)
    after = dict(trainer.model.named_parameters())
    for name, old in before.items():
        moved = not torch.equal(old, after[name].detach())
        if "lora_B" in name or (kind == "reward" and "modules_to_save" in name):
            assert moved, f"{name} should train"
        elif "lora_" not in name and "modules_to_save" not in name:
            assert not moved, f"base parameter {name} should stay frozen"


@pytest.mark.parametrize("kind", ["sft", "reward", "dpo", "kto"])
def test_train_with_eval_dataset(kind, toy_models, tmp_path):
    safe_trainer, _ = trainer_classes(kind)
    safe_config, _ = config_classes(kind)
    args = safe_config(
        **config_kwargs(kind, tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    )
    trainer = safe_trainer(
        toy_models[DEFAULT_MODEL[kind]],
        args=args,
        train_dataset=dataset_for(kind, 8),
        eval_dataset=dataset_for(kind, 4, seed=1),
    )
    losses(trainer)
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert evals and math.isfinite(evals[-1]["eval_loss"])


def test_train_with_eval_dataset_dict(toy_models, tmp_path):
    args = safe_trainers.DPOConfig(
        **config_kwargs("dpo", tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    )
    trainer = safe_trainers.DPOTrainer(
        toy_models["qwen2"],
        args=args,
        train_dataset=dataset_for("dpo", 8),
        eval_dataset={"a": dataset_for("dpo", 2, seed=1), "b": dataset_for("dpo", 2, seed=2)},
    )
    losses(trainer)
    keys = {k for entry in trainer.state.log_history for k in entry}
    assert {"eval_a_loss", "eval_b_loss"} <= keys


def test_dpo_explicit_ref_model_stays_frozen(toy_models, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"])
    ref = AutoModelForCausalLM.from_pretrained(toy_models["qwen2"])
    tokenizer = AutoTokenizer.from_pretrained(toy_models["qwen2"])
    trainer = safe_trainers.DPOTrainer(
        model,
        ref_model=ref,
        args=safe_trainers.DPOConfig(**config_kwargs("dpo", tmp_path)),
        train_dataset=dataset_for("dpo", 8),
        processing_class=tokenizer,
    )
    assert trainer.processing_class is tokenizer
    ref_before, model_before = snapshot(trainer.ref_model), snapshot(trainer.model)
    losses(trainer)
    assert all(torch.equal(p, ref_before[n]) for n, p in trainer.ref_model.named_parameters())
    assert any(not torch.equal(p, model_before[n]) for n, p in trainer.model.named_parameters())


def test_dpo_conversational_dataset(toy_models, tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in dataset_for("dpo", 8)
    ]
    trainer = safe_trainers.DPOTrainer(
        toy_models["qwen2"],
        args=safe_trainers.DPOConfig(**config_kwargs("dpo", tmp_path)),
        train_dataset=Dataset.from_list(rows),
    )
    before = snapshot(trainer.model)
    losses(trainer)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_kto_model_instance_and_tokenizer(toy_models, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(toy_models["llama"])
    tokenizer = AutoTokenizer.from_pretrained(toy_models["llama"])
    trainer = safe_trainers.KTOTrainer(
        model,
        args=safe_trainers.KTOConfig(**config_kwargs("kto", tmp_path)),
        train_dataset=dataset_for("kto", 8),
        processing_class=tokenizer,
    )
    assert trainer.model is model
    before = snapshot(model)
    losses(trainer)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_reward_model_instance_and_center_rewards(toy_models, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(toy_models["gemma2-rm"])
    args = safe_trainers.RewardConfig(**config_kwargs("reward", tmp_path, center_rewards_coefficient=0.01))
    trainer = safe_trainers.RewardTrainer(model, args=args, train_dataset=dataset_for("reward", 8))
    before = snapshot(model)
    losses(trainer)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_grpo_multiple_reward_functions_with_weights(toy_models, tmp_path):
    args = safe_trainers.GRPOConfig(**config_kwargs("grpo", tmp_path, reward_weights=[1.0, 0.5]))
    trainer = safe_trainers.GRPOTrainer(
        toy_models["qwen2"],
        reward_funcs=[rank_reward, count_words_reward],
        args=args,
        train_dataset=dataset_for("grpo", 8),
    )
    before = snapshot(trainer.model)
    losses(trainer)
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"rewards/rank_reward/mean", "rewards/count_words_reward/mean"} <= logged
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_grpo_model_instance(toy_models, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(toy_models["llama"])
    args = safe_trainers.GRPOConfig(**config_kwargs("grpo", tmp_path))
    trainer = safe_trainers.GRPOTrainer(
        model, reward_funcs=length_reward, args=args, train_dataset=dataset_for("grpo", 4)
    )
    assert trainer.model is model
    assert trainer.safety_report.findings == []


# --------------------------------------------------------------------------------------------------------------------
# One import line for the whole pipeline: every public name of `trl`
# --------------------------------------------------------------------------------------------------------------------


def _trl_public_objects() -> list[str]:
    # TRL's `__all__` lists its submodules too (`trl.trainer`, `trl.scripts`, ...): `from trl import *` brings objects
    return [name for name in trl.__all__ if importlib.util.find_spec(f"trl.{name}") is None]


def test_every_public_trl_name_is_trl_object_except_the_safe_classes():
    safe = {row.trainer_name for row in KIND_ROWS.values()} | {row.config_name for row in KIND_ROWS.values()}
    names = _trl_public_objects()
    assert {"ScriptArguments", "ModelConfig", "TrlParser", "DatasetMixtureConfig", "get_dataset"} <= set(names)
    for name in names:
        ours, theirs = getattr(safe_trainers, name), getattr(trl, name)
        if name in safe:
            assert ours is not theirs and issubclass(ours, theirs), name
        else:
            assert ours is theirs, name
    assert set(names) <= set(safe_trainers.__all__) and set(names) <= set(dir(safe_trainers))
    assert safe <= set(names)  # the six safe trainers and configs replace names TRL exports


def test_trl_experimental_and_submodules_are_not_shadowed():
    with pytest.raises(AttributeError, match="has no attribute 'experimental'"):
        safe_trainers.experimental  # noqa: B018
    with pytest.raises(ImportError):
        exec("from safe_trainers import experimental", {})
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        safe_trainers.no_such_name  # noqa: B018
    assert "trainer" not in safe_trainers.__all__ and "experimental" not in safe_trainers.__all__


IMPORT_PROBE = """
import json, sys
import safe_trainers
after_import = sorted(m for m in sys.modules if m.startswith("trl"))
from safe_trainers import TrlParser, get_peft_config
after_names = sorted(m for m in sys.modules if m.startswith("trl"))
namespace = {}
exec("from safe_trainers import *", namespace)
print(json.dumps({"import": after_import, "names": after_names, "star": sorted(k for k in namespace if k[0] != "_")}))
"""


@pytest.mark.slow  # a process of its own, or a real run
def test_import_stays_lazy_and_star_import_is_the_pipeline(tmp_path):
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # TRL's scripts module and the trainers safe_trainers does not wrap are imported only when asked for
    assert "trl.scripts" not in result["import"] and "trl.trainer.distillation_trainer" not in result["import"]
    assert "trl.scripts" in result["names"] and "trl.trainer.distillation_trainer" not in result["names"]
    assert set(result["star"]) == set(safe_trainers.__all__)
    assert "experimental" not in result["star"]
