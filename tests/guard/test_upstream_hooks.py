"""Never silently unguarded (`safe_trainers/trainer/hooks_ran.py`): a trainer whose hook of the guard does not run stops
with `UpstreamHookError` as soon as the hook should have run, naming the hook, the installed versions and the
supported ranges; the six trainers pass the check, which is on whenever the guard is.

Each family of hooks is taken out of a real trainer (`hook_utils.bypassing`: the subclass calls the upstream method
directly, as a subclass without `super()` or an upstream rename would), which then trains for real.
"""

from __future__ import annotations

import pytest
import torch
from hook_utils import bypassing
from transformers.trainer_callback import CallbackHandler

from safe_trainers.errors import UpstreamHookError
from safe_trainers.trainer.hooks_ran import CHECKED, hook_error_message, unran_hooks
from safe_trainers.testing.build import build_trainer
from safe_trainers.trainers import trainer_class
from safe_trainers.upstream.versions import installed_versions, supported_ranges, versions_note


KINDS = ["sft", "reward", "dpo", "kto", "grpo", "rloo"]
ALL_CHECKS = {"pre_optimizer_step", "step_end", "next_step", "save"}


def build(kind, toy_models, tmp_path, *hooks, **config):
    """A short guarded run of `kind` whose `hooks` skip safe_trainers' overrides (none: the safe trainer)."""
    model = toy_models["qwen2-rm" if kind == "reward" else "qwen2"]
    cls = bypassing(trainer_class(kind), *hooks) if hooks else trainer_class(kind)
    config = {"max_steps": 3, "save_strategy": "no", **config}
    if kind in ("sft", "rloo"):
        config.setdefault("bf16", False)
    return build_trainer(kind, model, tmp_path, preset="guarded", trainer_cls=cls, **config)


def stopped(trainer) -> UpstreamHookError:
    with pytest.raises(UpstreamHookError) as caught:
        trainer.train()
    return caught.value


def assert_names_hook_versions_and_opt_out(error: UpstreamHookError, *hooks: str) -> None:
    text = str(error)
    assert error.hooks == hooks and isinstance(error, RuntimeError)
    for hook in hooks:
        assert f"`{hook}`" in text
    installed, ranges = installed_versions(), supported_ranges()
    for package in ("transformers", "trl", "accelerate", "torch"):
        assert f"{package} {installed[package]}" in text  # read from the package metadata
        assert f"{package}{ranges[package]}" in text  # the range pyproject.toml declares
    assert "`nan_guard=False`" in text


def snapshot(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def unchanged(trainer, before) -> bool:
    return all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_without_the_grad_norm_hook_the_run_stops_before_its_first_update(toy_models, tmp_path):
    trainer = build("sft", toy_models, tmp_path / "guarded", "_get_grad_norm")
    before = snapshot(trainer)
    error = stopped(trainer)
    assert_names_hook_versions_and_opt_out(error, "transformers.Trainer._get_grad_norm")
    assert "before the first update" in str(error)
    assert trainer.state.global_step == 0 and unchanged(trainer, before)  # no unguarded update was applied
    # The documented way to train unprotected: the same trainer class trains to the end.
    unguarded = build("sft", toy_models, tmp_path / "unguarded", "_get_grad_norm", nan_guard=False)
    unguarded.train()
    assert unguarded.state.global_step == 3


def test_without_the_loss_hook_the_run_stops_before_its_first_update(toy_models, tmp_path):
    trainer = build("dpo", toy_models, tmp_path, "training_step")  # TRL's DPO `training_step`, not ours
    before = snapshot(trainer)
    error = stopped(trainer)
    assert_names_hook_versions_and_opt_out(error, "transformers.Trainer.training_step")
    assert trainer.state.global_step == 0 and unchanged(trainer, before)


@pytest.mark.parametrize(
    "kind,hook",
    [("grpo", "_generate_and_score_completions"), ("grpo", "_calculate_rewards"), ("rloo", "_calculate_rewards")],
)
def test_without_a_generation_hook_grpo_and_rloo_stop_before_their_first_update(toy_models, tmp_path, kind, hook):
    trainer = build(kind, toy_models, tmp_path, hook)
    before = snapshot(trainer)
    error = stopped(trainer)
    owner = {"grpo": "GRPOTrainer", "rloo": "RLOOTrainer"}[kind]
    assert_names_hook_versions_and_opt_out(error, f"trl.{owner}.{hook}")
    assert trainer.state.global_step == 0 and unchanged(trainer, before)


class NoPreOptimizerEvent(CallbackHandler):
    """A training loop that no longer fires `on_pre_optimizer_step` (where the guard hands over its skip)."""

    def on_pre_optimizer_step(self, args, state, control):
        return control


def test_without_the_pre_optimizer_event_the_run_stops_at_its_first_step(toy_models, tmp_path):
    trainer = build("sft", toy_models, tmp_path)
    trainer.callback_handler.__class__ = NoPreOptimizerEvent
    error = stopped(trainer)
    assert_names_hook_versions_and_opt_out(error, "transformers.TrainerCallback.on_pre_optimizer_step")
    assert trainer.state.global_step == 1  # found at the end of the first step: the event is the last hook before it


@pytest.mark.parametrize("hook", ["_save_checkpoint", "_get_output_dir"])
def test_a_checkpoint_saved_outside_the_staging_path_stops_the_run(toy_models, tmp_path, hook):
    trainer = build("sft", toy_models, tmp_path, hook, save_strategy="steps", save_steps=1)
    error = stopped(trainer)
    assert_names_hook_versions_and_opt_out(error, f"transformers.Trainer.{hook}")
    assert "at every save" in str(error) and trainer.state.global_step == 1


def test_without_the_log_window_hook_the_run_stops_after_its_first_step(toy_models, tmp_path):
    trainer = build("sft", toy_models, tmp_path, "_maybe_log_save_evaluate")
    error = stopped(trainer)
    assert_names_hook_versions_and_opt_out(error, "transformers.Trainer._maybe_log_save_evaluate")
    assert trainer.state.global_step == 1  # found before step 2 begins


def test_a_resume_that_bypasses_the_guard_stops_before_its_first_update(toy_models, tmp_path):
    first = build("sft", toy_models, tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    resumed = build("sft", toy_models, tmp_path, "_load_optimizer_and_scheduler")
    before = snapshot(resumed)
    error = stopped_resuming(resumed, str(tmp_path / "checkpoint-2"))
    assert_names_hook_versions_and_opt_out(error, "transformers.Trainer._load_optimizer_and_scheduler")
    assert resumed.state.global_step == 2
    assert all(torch.equal(p, first.model.get_parameter(n)) for n, p in resumed.model.named_parameters())
    assert not unchanged(resumed, before)  # the checkpoint's weights were loaded; no update after them
    healthy = build("sft", toy_models, tmp_path)  # the safe trainer resumes through the hook, and passes
    healthy.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert healthy.state.global_step == 3 and "_load_optimizer_and_scheduler" in healthy.safe_run.hooks_ran.steps
    assert healthy.safe_run.hooks_ran.checked == ALL_CHECKS - {"save"}


def stopped_resuming(trainer, checkpoint: str) -> UpstreamHookError:
    with pytest.raises(UpstreamHookError) as caught:
        trainer.train(resume_from_checkpoint=checkpoint)
    return caught.value


@pytest.mark.parametrize("kind", KINDS)
def test_the_check_runs_and_passes_on_all_six_trainers(toy_models, tmp_path, kind):
    trainer = build(kind, toy_models, tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    assert trainer.safe_run.hooks_ran.checked == ALL_CHECKS  # on by default, every check made and passed
    assert trainer.state.global_step == 2


def rows(*names):
    return [row for row in CHECKED if row.name in names]


def test_a_missing_attribute_or_hook_is_named_by_the_pure_check():
    trainer = {"transformers:Trainer", "transformers:TrainerCallback"}
    every_attribute = {row.name for row in CHECKED if row.kind == "attribute"}
    ran = {name: -1 for name in ("training_step", "_get_grad_norm", "_load_optimizer_and_scheduler")}
    # transformers 5.2: no `_tr_loss` (and no `_get_grad_norm` call).
    missing = unran_hooks(CHECKED, "pre_optimizer_step", ran, every_attribute - {"_tr_loss"}, trainer, set(), 1)
    assert [row.label for row in missing] == ["transformers.Trainer._tr_loss"]
    missing = unran_hooks(CHECKED, "pre_optimizer_step", {"training_step": -1}, every_attribute, trainer, set(), 1)
    assert [row.name for row in missing] == ["_get_grad_norm"]
    # GRPO's hooks concern GRPO only; resume's only a resumed run.
    grpo = trainer | {"trl:GRPOTrainer"}
    missing = unran_hooks(CHECKED, "pre_optimizer_step", ran, every_attribute, grpo, {"resumed"}, 1)
    assert [row.name for row in missing] == ["_generate_and_score_completions", "_calculate_rewards"]
    assert unran_hooks(CHECKED, "pre_optimizer_step", {"training_step": -1, "_get_grad_norm": -1},
                       every_attribute, trainer, set(), 1) == []  # fmt: skip
    # A save's hooks must have run at this step; the staging directory only when the checkpoint was written.
    saved = {"_save_checkpoint": 4, "_get_output_dir": 4}
    assert unran_hooks(CHECKED, "save", saved, set(), trainer, {"saved"}, 4) == []
    assert [r.name for r in unran_hooks(CHECKED, "save", saved, set(), trainer, {"saved"}, 8)] == list(saved)
    assert unran_hooks(CHECKED, "save", {"_save_checkpoint": 8}, set(), trainer, set(), 8) == []
    message = hook_error_message(rows("_tr_loss", "_get_grad_norm"), "pre_optimizer_step", "VERSIONS.")
    assert "`transformers.Trainer._tr_loss` does not exist" in message and "added in transformers 5.3.0" in message
    assert "`transformers.Trainer._get_grad_norm` was not called" in message and "VERSIONS." in message


def test_the_versions_note_names_installed_versions_and_declared_ranges():
    note = versions_note({"transformers": "5.2.0", "trl": "1.16.0", "torch": None}, {"transformers": ">=5.3,<6"})
    assert note == (
        "Installed: transformers 5.2.0, trl 1.16.0, torch (not installed); supported by safe-trainers: "
        "transformers>=5.3,<6."
    )
    assert "not installed as a package" in versions_note({"trl": "1.16.0"}, {"trl": None})


@pytest.mark.distributed
def test_every_ddp_rank_stops_at_a_missing_hook_and_none_hangs(tmp_path):
    from test_guard_distributed import accelerate_ddp, launch

    results = launch(accelerate_ddp(), "sft", [], tmp_path, "--bypass", "_get_grad_norm", "--save_steps", "100")
    outcome = "stopped: transformers.Trainer._get_grad_norm"
    assert [(r["outcome"], r["global_step"]) for r in results] == [(outcome, 0)] * 2
