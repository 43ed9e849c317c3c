"""`LossLedger` (`guard/step/ledger.py`): the logged loss of a window with a skipped step is the mean of its applied
steps; a window without one leaves the Trainer's own value; `train_loss` counts the applied steps of the whole run."""

from __future__ import annotations

import math

import pytest
import torch

from safe_trainers.guard.step.ledger import LossLedger


def step(ledger: LossLedger, losses: list[float], skipped: bool) -> None:
    for loss in losses:
        ledger.add_micro_batch(torch.tensor(loss))
    ledger.end_step(torch.tensor(skipped))


def test_a_window_without_a_skipped_step_keeps_the_trainers_value():
    ledger = LossLedger()
    step(ledger, [1.0, 2.0], skipped=False)
    step(ledger, [3.0], skipped=False)
    assert ledger.close_window() is None and ledger.train_loss() is None


def test_a_window_with_a_skipped_step_reports_the_mean_of_its_applied_steps():
    ledger = LossLedger()
    step(ledger, [1.0, 2.0], skipped=False)  # a step's loss is the sum over its micro-batches, as the Trainer adds
    step(ledger, [math.nan, 5.0], skipped=True)
    step(ledger, [4.0], skipped=False)
    ledger.record_skips(1)
    assert ledger.close_window() == (3.0 + 4.0) / 2
    step(ledger, [6.0], skipped=False)  # the next window has no skip: the Trainer's own value stands
    assert ledger.close_window() is None
    # The run had a skip: `train_loss` is the mean over its applied steps.
    assert ledger.train_loss() == pytest.approx((3.0 + 4.0 + 6.0) / 3)


def test_a_window_of_skipped_steps_only_reports_nothing_and_a_new_run_forgets():
    ledger = LossLedger()
    step(ledger, [math.nan], skipped=True)
    ledger.record_skips(1)
    assert ledger.close_window() is None  # no applied step to average: the Trainer's value stands
    assert ledger.train_loss() is None
    ledger.begin_run()
    step(ledger, [2.0], skipped=False)
    assert ledger.close_window() is None and ledger.run_skips == 0


def test_a_step_with_no_loss_observed_adds_nothing():
    ledger = LossLedger()
    ledger.end_step(torch.tensor(True))  # e.g. a poisoned step whose batches were not trained
    step(ledger, [2.0], skipped=False)
    ledger.record_skips(1)
    assert ledger.close_window() == 2.0
