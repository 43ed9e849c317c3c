"""`guard/state.py`: the guard's state saved with every checkpoint (counters, LR backoff, the spike window) and read
back on resume, including files of runs without a guard or from before a field existed."""

import json

import pytest
import torch

from safe_trainers.guard.step.spikes import SpikeSettings, SpikeWindow
from safe_trainers.guard.state import GUARD_STATE_FILE, GuardState

SETTINGS = SpikeSettings(6.0, window=8, warmup=4)
APPLIED = torch.tensor(True)


def fed_window(losses: list[float], norms: list[float]) -> SpikeWindow:
    window = SpikeWindow(SETTINGS)
    for loss, norm in zip(losses, norms):
        window.judge(torch.tensor(loss), torch.tensor(norm), APPLIED)
    return window


def test_a_saved_state_loads_back_field_for_field(tmp_path):
    state = GuardState(
        skipped_steps=3, overflow_steps=2, rollbacks=1, discarded_steps=5, lr_scale=0.25, learning_rate=3e-4,
        localized=True, spike_steps=2,
    )
    window = fed_window([1.0, 1.1, 0.9, 1.05, 0.95], [2.0, 2.2, 1.8, 2.1, 1.9])
    state.save(str(tmp_path), window)
    loaded = GuardState.load(str(tmp_path))
    assert loaded == state
    assert loaded.spike_window == window.history()
    assert loaded.spike_window["loss"] == pytest.approx([1.0, 1.1, 0.9, 1.05, 0.95])


def test_a_wrapped_window_round_trips_oldest_first_and_judges_alike(tmp_path):
    # 13 steps through a window of 8: the ring buffer has wrapped; the file keeps the last 8, oldest first.
    losses = [1.0 + 0.01 * (i % 5) for i in range(13)]
    norms = [2.0 + 0.02 * (i % 3) for i in range(13)]
    window = fed_window(losses, norms)
    GuardState().save(str(tmp_path), window)
    loaded = GuardState.load(str(tmp_path))
    assert loaded.spike_window["loss"] == pytest.approx(losses[-8:])
    assert loaded.spike_window["grad_norm"] == pytest.approx(norms[-8:])
    resumed = SpikeWindow(SETTINGS, loaded.spike_window)
    assert resumed.history() == loaded.spike_window  # not used yet: the saved window as it was
    for loss, expected in [(1.02, False), (50.0, True), (1.01, False)]:
        got = [bool(w.judge(torch.tensor(loss), torch.tensor(2.0), APPLIED)) for w in (window, resumed)]
        assert got == [expected, expected]
    assert resumed.history() == window.history()


def test_saving_without_a_detector_clears_the_window(tmp_path):
    state = GuardState(spike_window={"loss": [1.0], "grad_norm": [2.0]})
    state.save(str(tmp_path))
    assert GuardState.load(str(tmp_path)).spike_window is None


def test_a_checkpoint_without_the_file_has_no_state(tmp_path):
    assert GuardState.load(str(tmp_path)) is None


def test_an_older_file_loads_with_defaults_and_ignores_unknown_keys(tmp_path):
    # A state written before spike detection existed, with a key a later version may have dropped.
    old = {"skipped_steps": 4, "rollbacks": 1, "discarded_steps": 2, "lr_scale": 0.5, "retired_field": 7}
    (tmp_path / GUARD_STATE_FILE).write_text(json.dumps(old))
    loaded = GuardState.load(str(tmp_path))
    assert loaded == GuardState(skipped_steps=4, rollbacks=1, discarded_steps=2, lr_scale=0.5)
    assert loaded.spike_steps == 0 and loaded.spike_window is None
    assert SpikeWindow(SETTINGS, loaded.spike_window).history() is None


def test_the_counters_are_what_every_log_gets():
    state = GuardState(skipped_steps=1, overflow_steps=2, rollbacks=3, discarded_steps=4, spike_steps=5)
    assert state.counters() == {
        "nan_guard/skipped_steps": 1,
        "nan_guard/rollbacks": 3,
        "nan_guard/discarded_steps": 4,
        "nan_guard/overflow_steps": 2,
        "nan_guard/spike_steps": 5,
    }
