"""`trainer/run.py` and `trainer/run_control.py` on their own: where the preemption callback and the hang watchdog go
in a guarded trainer's callback list (and that neither comes without the guard), when `after_boundary` exits, what
`after_train` puts back, and what `preempted_at_end` does after a run that finished although a preemption was asked
for."""

from __future__ import annotations

import os
import signal

import pytest
from transformers.trainer_callback import DefaultFlowCallback

from safe_trainers.restarts.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption
from safe_trainers.restarts.watchdog import HangWatchdog
from safe_trainers.trainer.callbacks import HangWatchdogCallback, PreemptionCallback, StepProgressCallback
from safe_trainers.runtime.ports import UNWATCHED
from safe_trainers.testing.build import build_trainer
from safe_trainers.trainer.callbacks import NanGuardCallback
from safe_trainers.trainer.hooks_ran import HookCheckCallback
from safe_trainers.trainer.run_control import after_boundary, after_train, preempted_at_end


def build(toy_models, tmp_path, **config):
    return build_trainer("sft", toy_models["qwen2"], tmp_path / "out", preset="guarded", **config)


def index(trainer, cls) -> int:
    found = [i for i, cb in enumerate(trainer.callback_handler.callbacks) if isinstance(cb, cls)]
    assert len(found) <= 1
    return found[0] if found else -1


def received(preemption: Preemption, sig: signal.Signals = signal.SIGUSR1) -> None:
    """A real signal to this process, through the preemption's own handler (put back afterwards)."""
    preemption.install()
    try:
        os.kill(os.getpid(), sig)
    finally:
        preemption.restore()
    assert preemption.received is sig


# ---------------------------------------------------------------------------------------------------- attaching
def test_a_built_trainer_puts_preemption_right_after_the_flow_and_the_watchdog_right_after_the_guard(
    toy_models, tmp_path
):
    # Right after the flow callback comes the hook check (first of all: the guard's upstream hooks ran), then
    # preemption: before the step record and the guard.
    trainer = build(toy_models, tmp_path, preempt_signals=[], hang_timeout=0)
    guard = trainer.nan_guard
    assert index(trainer, PreemptionCallback) == index(trainer, HangWatchdogCallback) == -1
    assert trainer.safe_run.preemption is None and guard.clock is UNWATCHED
    assert guard.riders == ()  # one process: nothing rides on an all-reduce

    settings = dict(preempt_signals=["usr1", "SIGTERM"], hang_timeout=30.0, hang_timeout_factor=5.0)
    trainer = build(toy_models, tmp_path / "attached", hang_action="auto", **settings)
    guard = trainer.nan_guard
    callbacks = trainer.callback_handler.callbacks
    assert index(trainer, HookCheckCallback) == index(trainer, DefaultFlowCallback) + 1
    preemption = callbacks[index(trainer, HookCheckCallback) + 1].preemption
    assert isinstance(preemption, Preemption) and preemption is trainer.safe_run.preemption
    assert guard.riders == ()  # one process: the flag is read directly
    assert preemption.signals == (signal.SIGUSR1, signal.SIGTERM) and preemption.events is guard.events
    watchdog = callbacks[index(trainer, NanGuardCallback) + 1].watchdog
    assert isinstance(watchdog, HangWatchdog) and watchdog is trainer.safe_run.watchdog is guard.clock
    assert (watchdog.output_dir, watchdog.rank, watchdog.ceiling, watchdog.factor) == (
        trainer.args.output_dir, 0, 30.0, 5.0,
    )  # fmt: skip
    assert watchdog._thread is None  # started by `on_train_begin`, not when built


@pytest.mark.parametrize(
    "signals, hang_timeout", [(["SIGTERM", "SIGUSR1"], 900.0), (["SIGUSR1"], 0.0), ([], 60.0), ([], 0.0)]
)
def test_a_built_trainer_has_each_only_when_its_setting_asks(toy_models, tmp_path, signals, hang_timeout):
    trainer = build(toy_models, tmp_path, preempt_signals=signals, hang_timeout=hang_timeout)
    preemption, guard, watchdog = (
        index(trainer, PreemptionCallback), index(trainer, NanGuardCallback), index(trainer, HangWatchdogCallback),
    )  # fmt: skip
    assert (preemption >= 0) is bool(signals) and (watchdog >= 0) is (hang_timeout > 0)
    # Preemption decides its stop (and asks for the save) before the step record closes the step and the guard
    # verifies; the watchdog's step ends after the guard's inspection, so that is timed with the step.
    if signals:
        assert index(trainer, DefaultFlowCallback) < preemption < index(trainer, StepProgressCallback) < guard
    if hang_timeout > 0:
        assert watchdog == guard + 1


def test_neither_is_attached_without_the_guard(toy_models, tmp_path):
    # The defaults ask for both (SIGTERM and SIGUSR1, a 900 s ceiling); with `nan_guard=False` neither comes.
    trainer = build(toy_models, tmp_path, nan_guard=False)
    assert index(trainer, PreemptionCallback) == index(trainer, HangWatchdogCallback) == -1
    assert index(trainer, NanGuardCallback) == -1
    assert trainer.safe_run.preemption is None and trainer.safe_run.watchdog is None
    after_train(trainer)  # nothing to put back
    after_boundary(trainer)
    assert preempted_at_end(trainer) is None


# ---------------------------------------------------------------------------------------------------- after_boundary
def test_after_boundary_exits_only_at_the_stopping_step_before_the_last(toy_models, tmp_path):
    trainer = build(toy_models, tmp_path, preempt_signals=["SIGUSR1"])  # `max_steps=10`
    preemption, state = trainer.safe_run.preemption, trainer.state
    state.global_step, state.max_steps = 3, 10
    after_boundary(trainer)  # no signal: nothing
    received(preemption)
    after_boundary(trainer)  # a signal, but no agreed stopping step yet: nothing
    preemption.stopping_at = 4
    after_boundary(trainer)  # the ranks stop at a later step
    preemption.stopping_at = 3
    with pytest.raises(Preempted) as exit_:
        after_boundary(trainer)
    assert (exit_.value.code, exit_.value.step, exit_.value.signal) == (PREEMPTED_EXIT_CODE, 3, "SIGUSR1")
    (event,) = trainer.nan_guard.events.events
    assert (event.step, event.kind, event.ranks, event.detail["checkpoint_step"]) == (3, "preempt", [0], 3)

    state.global_step = preemption.stopping_at = 10  # the last step: training ends as usual, `train()` exits after
    after_boundary(trainer)


def test_after_boundary_does_nothing_without_preemption(toy_models, tmp_path):
    trainer = build(toy_models, tmp_path, preempt_signals=[])
    trainer.state.global_step, trainer.state.max_steps = 3, 10
    after_boundary(trainer)
    assert trainer.nan_guard.events.events == []


# ---------------------------------------------------------------------------------------------------- after_train
def test_after_train_puts_the_handlers_back_and_stops_the_watchdog(toy_models, tmp_path):
    trainer = build(toy_models, tmp_path, preempt_signals=["SIGUSR1"], hang_timeout=900.0)
    before = signal.getsignal(signal.SIGUSR1)
    trainer.safe_run.preemption.install()
    trainer.safe_run.watchdog.start()
    thread = trainer.safe_run.watchdog._thread
    try:
        assert signal.getsignal(signal.SIGUSR1) == trainer.safe_run.preemption._handle and thread.is_alive()
    finally:
        after_train(trainer)
    assert signal.getsignal(signal.SIGUSR1) == before
    assert not thread.is_alive() and trainer.safe_run.watchdog._thread is None


# ---------------------------------------------------------------------------------------------------- preempted_at_end
@pytest.fixture
def finished(toy_models, tmp_path):
    """A guarded trainer whose 2-step run finished without a checkpoint of its last step."""
    trainer = build(toy_models, tmp_path, preempt_signals=["SIGUSR1"], max_steps=2, save_strategy="no")
    trainer.train()
    assert not os.path.isdir(tmp_path / "out" / "checkpoint-2")
    return trainer


def test_no_preemption_asked_no_exit(finished, tmp_path):
    assert preempted_at_end(finished) is None
    assert not os.path.isdir(tmp_path / "out" / "checkpoint-2") and finished.nan_guard.events.events == []


def test_a_signal_after_the_last_step_publishes_it_once_and_exits_preempted(finished, tmp_path):
    received(finished.safe_run.preemption)
    exit_ = preempted_at_end(finished)
    assert isinstance(exit_, Preempted) and (exit_.code, exit_.step, exit_.signal) == (75, 2, "SIGUSR1")
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert os.path.isfile(checkpoint / "trainer_state.json")  # the finished state, verified and published
    (event,) = finished.nan_guard.events.events
    assert (event.step, event.kind, event.ranks) == (2, "preempt", [0])
    assert event.detail["finished"] is True and event.detail["checkpoint_step"] == 2
    inode = os.stat(checkpoint).st_ino
    assert isinstance(preempted_at_end(finished), Preempted)  # asked again: the step is saved already
    assert os.stat(checkpoint).st_ino == inode


def test_a_stop_agreed_for_another_ranks_signal_exits_too(finished, tmp_path):
    finished.safe_run.preemption.stopping_at = 2  # the agreed bit came from another rank: this one received nothing
    exit_ = preempted_at_end(finished)
    assert exit_.signal == "a signal on another rank" and os.path.isdir(tmp_path / "out" / "checkpoint-2")


def test_a_call_resumed_from_the_final_checkpoint_does_not_save_it_again(finished, tmp_path):
    finished.nan_guard.resumed_from = str(tmp_path / "elsewhere" / "checkpoint-2")  # trained nothing: it holds step 2
    received(finished.safe_run.preemption)
    assert isinstance(preempted_at_end(finished), Preempted)
    assert not os.path.isdir(tmp_path / "out" / "checkpoint-2")
