"""The paths of `docs/design/layout.md`, as the code runs them: the modules of `safe_trainers` entered by one NaN step,
from the Trainer's `training_step` to the skip (`skip_if_faulted`), and by one rollback, from the verdict
(`NanGuard.settle`) to the restored state (`restore_last_good`)."""

from __future__ import annotations

import sys

from transformers import TrainerCallback

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.faults import Fault

PACKAGE = "/safe_trainers/"
MOST_MODULES = 12  # issue 29, "Done when": a NaN step from `training_step` to the skip enters at most 12 modules


class ModulesEntered(TrainerCallback):
    """From the start of step `step`: the package's modules entered (in order) from the first `training_step` call to
    the first `skip_if_faulted` call, both included; the fault injector's own module left out."""

    def __init__(self, step: int):
        self.step = step
        self.modules: list[str] = []
        self.started = self.done = False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            sys.setprofile(self._profile)

    def _profile(self, frame, event, arg):
        if event != "call" or self.done:
            return
        path = frame.f_code.co_filename
        if PACKAGE not in path or "/testing/" in path:
            return
        module = path.rsplit(PACKAGE, 1)[1]
        self.started = self.started or frame.f_code.co_name == "training_step"
        if not self.started:
            return
        if module not in self.modules:
            self.modules.append(module)
        if frame.f_code.co_name == "skip_if_faulted":
            self.done = True
            sys.setprofile(None)


def test_a_nan_step_reaches_the_skip_through_at_most_twelve_modules(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=3, kind="loss")], max_steps=3
    )
    entered = ModulesEntered(step=3)
    trainer.add_callback(entered)
    try:
        trainer.train()
    finally:
        sys.setprofile(None)
    assert entered.done, entered.modules  # the step was skipped
    assert len(entered.modules) <= MOST_MODULES, " -> ".join(entered.modules)


MOST_ROLLBACK_MODULES = 10  # issue 29, "Done when": a rollback from the verdict to the restored state, at most 10


class RollbackModules:
    """The package's modules entered, in order, from `NanGuard.settle` on a verdict that rolls back until the
    restore (`restore_last_good`) returns: the path of `docs/design/layout.md`, "The path of one rollback"."""

    def __init__(self):
        self.modules: list[str] = []
        self.started = self.done = False

    def profile(self, frame, event, arg):
        path = frame.f_code.co_filename
        if self.done or PACKAGE not in path or "/testing/" in path:
            return
        module, name = path.rsplit(PACKAGE, 1)[1], frame.f_code.co_name
        if event == "call" and name == "settle" and frame.f_locals["judged"].verdict.rollback is not None:
            self.started = True
        if self.started and event == "call" and module not in self.modules:
            self.modules.append(module)
        if self.started and event == "return" and name == "restore_last_good":
            self.done = True


def test_a_rollback_reaches_the_restored_state_through_at_most_ten_modules(toy_models, tmp_path):
    trainer = build_trainer(
        "dpo", toy_models["qwen2"], tmp_path, preset="guarded", faults=[Fault(step=3, kind="weight")], max_steps=4
    )
    entered = RollbackModules()
    sys.setprofile(entered.profile)
    try:
        trainer.train()
    finally:
        sys.setprofile(None)
    assert entered.done, entered.modules  # the state was rolled back
    assert len(entered.modules) <= MOST_ROLLBACK_MODULES, " -> ".join(entered.modules)
    assert entered.modules[0] == "guard/nan_guard.py" and "guard/records.py" not in entered.modules  # books after
