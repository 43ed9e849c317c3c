"""`SafeTrainerMixin`: runs the safety rules around a TRL trainer's constructor and attaches the NaN guard."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
from typing import Any, ClassVar

import torch
from transformers.trainer_utils import get_last_checkpoint, rotate_checkpoints

from .apply import apply_to_setup, apply_to_trainer
from .arguments import SafetyArguments
from .engine import new_report, run_stage, select_rules
from .guard import NanGuard, NanGuardCallback
from .guard.checkpoint import clean_staging, publish, staging_run_dir
from .kinds import get_kind
from .report import SafetyReport
from .rules import BuiltTrainer
from .setup import TrainerSetup, build_setup


logger = logging.getLogger("safe_trainers")


class SafeTrainerMixin:
    """Mixed in before a TRL trainer class. Same constructor signature as the TRL class; adds `safety_report` and
    `nan_guard`.

    Construction runs in three steps:
    1. the rules that only need the config and the model's `config.json` run first, before any weight is loaded; a
       blocked finding raises [`SafetyError`] here;
    2. the TRL constructor runs with the fixed config, PEFT config and model;
    3. the rules that need the loaded model or the tokenized dataset run on the built trainer.
    The report is logged once on the main process and written to `output_dir/safety_report.json`.

    Training: with `nan_guard=True` (the default) a [`NanGuard`] watches every optimizer step (see `guard/`), and
    checkpoints are written to a staging directory, checked, then renamed, so a checkpoint on disk is never
    half-written and never holds non-finite weights.
    """

    _safety_kind: ClassVar[str]
    _safety_config_class: ClassVar[type]
    _trl_class: ClassVar[type]
    safety_report: SafetyReport

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("_safety_kind")
        if kind is not None:
            # TRL's class and the safe config come from the kind's row of the table, unless the class names its own.
            row = get_kind(kind)
            if "_trl_class" not in cls.__dict__:
                cls._trl_class = row.trl_trainer
            if "_safety_config_class" not in cls.__dict__:
                cls._safety_config_class = row.config
        trl_class = cls.__dict__.get("_trl_class")
        if trl_class is not None and "__init__" not in cls.__dict__:
            # Give each trainer TRL's own signature and docstring (IDEs, `inspect.signature`, docs).
            @functools.wraps(trl_class.__init__)
            def __init__(self, *args: Any, **kwargs: Any):
                SafeTrainerMixin.__init__(self, *args, **kwargs)

            cls.__init__ = __init__

    def __init__(self, *args: Any, **kwargs: Any):
        bound = inspect.signature(self._trl_class.__init__).bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        setup = self._build_setup(arguments)
        settings = SafetyArguments.from_config(setup.args)
        enabled, disabled = select_rules(self._safety_kind, settings)
        report = new_report(self._safety_kind, settings, disabled)
        if settings.safety_mode != "off":
            setup = run_stage(setup, enabled, settings, report, check=lambda r, s: r.check(s), apply=apply_to_setup)
        source = setup.train_dataset
        source_rows = len(source) if source is not None and hasattr(source, "__len__") else None
        arguments["args"] = setup.args
        if "peft_config" in arguments or setup.peft_config is not None:
            arguments["peft_config"] = setup.peft_config

        # Set before TRL's constructor runs, since the hooks below read them.
        self.nan_guard: NanGuard | None = None
        self._staging_checkpoint = False
        self._last_finite_total_loss = 0.0
        super().__init__(**arguments)

        self.safety_settings = settings
        self.safety_report = report
        if settings.safety_mode != "off":
            check_built = functools.partial(_check_built, source_rows=source_rows)
            run_stage(self, enabled, settings, report, check=check_built, apply=apply_to_trainer)
        self._publish_safety_report()
        if settings.nan_guard:
            self.nan_guard = NanGuard(self, settings)
            self.add_callback(NanGuardCallback(self.nan_guard))

    def _build_setup(self, arguments: dict[str, Any]) -> TrainerSetup:
        model = arguments.get("model")
        args = arguments.get("args")
        if args is None:
            # Mirror TRL: the default config is named after the model.
            if isinstance(model, str):
                name = model
            else:
                from trl.trainer.utils import get_config_model_id

                name = get_config_model_id(model.config)
            suffix = get_kind(self._safety_kind).run_suffix
            args = self._safety_config_class(f"{name.split('/')[-1]}-{suffix}")
        return build_setup(
            self._safety_kind,
            args,
            model,
            ref_model=arguments.get("ref_model"),
            peft_config=arguments.get("peft_config"),
            train_dataset=arguments.get("train_dataset"),
        )

    def _publish_safety_report(self) -> None:
        if not self.is_world_process_zero():
            return
        text = self.safety_report.render()
        if any(f.action in ("fixed", "warned") for f in self.safety_report.findings):
            logger.warning(text)
        else:
            logger.info(text)
        self.safety_report.write_json(self.args.output_dir)


    # ------------------------------------------------------------------ NaN guard hooks
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval=None, **kwargs):
        if self.nan_guard is not None:
            if self.is_world_process_zero():
                for path in clean_staging(self.args.output_dir):
                    logger.warning(f"NaN guard: removed a half-written checkpoint left by an interrupted save: {path}")
            checkpoint = resume_from_checkpoint
            if checkpoint is True:
                checkpoint = get_last_checkpoint(self.args.output_dir)
            if isinstance(checkpoint, str):
                self.nan_guard.load_state(checkpoint)
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
        )

    def set_initial_training_values(self, args, dataloader):
        values = list(super().set_initial_training_values(args, dataloader))
        num_train_epochs, steps_per_epoch = values[0], values[1]
        if self.nan_guard is not None and args.max_steps > 0 and steps_per_epoch:
            # A rollback drops the batches since the last snapshot instead of replaying them, so a run bounded by
            # `max_steps` may need more data than `max_steps` batches: allow extra epochs (the loop still stops at
            # `max_steps`, so without rollbacks nothing changes).
            s = self.safety_settings
            dropped = s.nan_max_rollbacks * (s.nan_snapshot_steps + s.nan_max_consecutive_skips)
            values[0] = num_train_epochs + math.ceil(dropped / steps_per_epoch)
        return tuple(values)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        guard = self.nan_guard
        if guard is not None and model.training and not guard.replaying:
            guard.observe_loss(result[0] if isinstance(result, tuple) else result, inputs)
        return result

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self.nan_guard is not None:
            self.nan_guard.end_of_step(grad_norm)
        return grad_norm

    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return staging_run_dir(run_dir) if self._staging_checkpoint else run_dir

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint to a staging directory, then rename it: never half-written, never non-finite."""
        guard = self.nan_guard
        if guard is None:
            return super()._save_checkpoint(model, trial)
        step = self.state.global_step
        if not guard.state_verified():
            guard.refuse_save(step)
            return
        run_dir = self._get_output_dir(trial)
        staged = os.path.join(staging_run_dir(run_dir), f"checkpoint-{step}")
        self._staging_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_checkpoint = False
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            guard.save_state(staged)
            publish(staged, os.path.join(run_dir, f"checkpoint-{step}"))
            if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging_run_dir(run_dir)):
                self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(self.state.best_model_checkpoint))
        self.accelerator.wait_for_everyone()
        if self.args.should_save and not guard.aborting:
            # The checkpoint saved on abort holds the last good state, usually older than the newest checkpoint:
            # rotating by step number would delete it first, so it is exempt.
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=False,
            )

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.nan_guard is not None:
            if "loss" in logs:
                # A non-finite loss is logged as such (`logging.show_nonfinite`); the running totals must not stay
                # NaN forever after it.
                if isinstance(self._tr_loss, torch.Tensor) and not bool(torch.isfinite(self._tr_loss)):
                    self._tr_loss.zero_()
                if math.isfinite(self._total_loss_scalar):
                    self._last_finite_total_loss = self._total_loss_scalar
                else:
                    self._total_loss_scalar = self._last_finite_total_loss
            if "train_runtime" not in logs:
                logs.update(self.nan_guard.log_counters())
        super().log(logs, *args, **kwargs)


def _check_built(rule, trainer, source_rows: int | None = None) -> Any:
    built = BuiltTrainer(
        kind=trainer._safety_kind,
        args=trainer.args,
        model=trainer.model,
        train_dataset=trainer.train_dataset,
        source_rows=source_rows,
        peft_config=getattr(getattr(trainer.model, "peft_config", None), "get", lambda _: None)("default"),
    )
    return rule.check_built(built)
