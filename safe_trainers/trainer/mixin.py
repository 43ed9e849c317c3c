"""`SafeTrainerMixin`: runs the safety rules around a TRL trainer's constructor and attaches the NaN guard."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, ClassVar

from ..arguments import SafetyArguments
from ..configs import config_class
from ..guard import NanGuard
from ..guard.snapshot_bounds import describe as describe_snapshots
from ..kinds import get_kind
from ..restarts.preemption import refuse_jit_checkpoint
from ..rules.context import TrainerSetup, build_setup
from ..rules.engine import select_rules
from ..rules.report import SafetyReport
from ..rules.stages import run_built_rules, run_setup_rules
from .hooks import NanGuardTrainerMixin
from .run import SafeRun, build_run, install_callbacks

logger = logging.getLogger("safe_trainers")


class SafeTrainerMixin(NanGuardTrainerMixin):
    """Mixed in before a TRL trainer class. Same constructor signature as the TRL class; adds `safety_report` and
    `nan_guard`.

    Construction runs in three steps:
    1. the rules that only need the config and the model's `config.json` run first, before any weight is loaded; a
       blocked finding raises [`SafetyError`] here;
    2. the TRL constructor runs with the fixed config, PEFT config and model;
    3. the rules that need the loaded model or the tokenized dataset run on the built trainer.
    The report is logged once on the main process and written to `output_dir/safety_report.json`.

    Training: with `nan_guard=True` (the default) a [`NanGuard`] watches every optimizer step (see `guard/`), and
    [`NanGuardTrainerMixin`] keeps the Trainer's bookkeeping (logs, checkpoints, resume) consistent with it.
    """

    _safety_kind: ClassVar[str]
    _safety_config_class: ClassVar[type]
    _trl_class: ClassVar[type]
    safety_report: SafetyReport

    @property
    def safety_kind(self) -> str:
        """The trainer kind whose rules apply (`"sft"`, `"dpo"`, ...): the row of `kinds.py` the class was built
        from."""
        return self._safety_kind

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("_safety_kind")
        if kind is not None:
            # TRL's class and the safe config come from the kind's row of the table, unless the class names its own.
            row = get_kind(kind)
            if "_trl_class" not in cls.__dict__:
                cls._trl_class = row.trl_trainer
            if "_safety_config_class" not in cls.__dict__:
                cls._safety_config_class = config_class(kind)
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
        refuse_jit_checkpoint(setup.args, settings.nan_guard)  # before transformers installs its SIGTERM handler
        setup, report = run_setup_rules(setup, settings)
        source = setup.train_dataset
        source_rows = len(source) if source is not None and hasattr(source, "__len__") else None
        arguments["args"] = setup.args
        if "peft_config" in arguments or setup.peft_config is not None:
            arguments["peft_config"] = setup.peft_config

        # Set before TRL's constructor runs, since the Trainer hooks read them.
        self.nan_guard: NanGuard | None = None
        self.safe_run = SafeRun()
        super().__init__(**arguments)

        self.safety_settings = settings
        self.safety_report = report
        run_built_rules(self, settings, report, source_rows)
        self._publish_safety_report(settings)
        if settings.nan_guard:
            # The guard, its event log, the step record, preemption and the watchdog, with their callbacks right
            # after the flow callback, in their priority order (`run.py`).
            self.safe_run = build_run(self, settings)
            self.nan_guard = self.safe_run.guard
            install_callbacks(self, self.safe_run)

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
            processing_class=arguments.get("processing_class"),
        )

    def _publish_safety_report(self, settings: SafetyArguments) -> None:
        """Write the report to `output_dir` and print it on the main process: in full when a rule fired, else one
        line (see [`SafetyReport.construction_summary`])."""
        if not self.is_world_process_zero():
            return
        path = self.safety_report.write_json(self.args.output_dir)
        enabled, _ = select_rules(self._safety_kind, settings)
        snapshots = describe_snapshots(settings, self.args)
        logger.warning(self.safety_report.construction_summary(len(enabled), settings.nan_guard, path, snapshots))
