"""The training loss as the logs report it, counted over the steps whose update was applied.

The Trainer averages every step's loss between two logs, and `train_loss` over the whole run. A step the guard skipped
has no applied update and usually a NaN loss, which would turn both averages into NaN (or, with
`logging_nan_inf_filter`, into an invented value). The ledger keeps, on the device and without host synchronisation,
the sum and count of the applied steps' losses; where a window held a skipped step, the Trainer's `log` (see
`trainer/hooks.py`) reports the ledger's mean instead of its own. Windows without a skipped step keep the Trainer's own
value, bit for bit.
"""

from __future__ import annotations

import torch

from ...runtime.collectives import mean_across_ranks


class LossLedger:
    """Sums of the applied steps' losses: of the current log window, and of the run so far."""

    def __init__(self):
        self.begin_run()

    def begin_run(self) -> None:
        self._step: torch.Tensor | None = None
        self._window_sum: torch.Tensor | float = 0.0
        self._window_count: torch.Tensor | float = 0.0
        self._run_sum: torch.Tensor | float = 0.0
        self._run_count: torch.Tensor | float = 0.0
        self.window_skips = 0
        self.run_skips = 0

    def add_micro_batch(self, loss: torch.Tensor) -> None:
        """The loss `training_step` returned for one micro-batch (what the Trainer adds to its running total)."""
        loss = loss.detach()
        self._step = loss if self._step is None else self._step + loss

    def end_step(self, skipped: torch.Tensor) -> None:
        """Close one optimizer step; `skipped` is the guard's device flag for it."""
        if self._step is None:
            return
        self._window_sum = self._window_sum + torch.where(skipped, torch.zeros_like(self._step), self._step)
        self._window_count = self._window_count + (~skipped).to(self._step.dtype)
        self._step = None

    def record_skips(self, count: int) -> None:
        """Called at an inspection with the number of skipped steps it found (host-side)."""
        self.window_skips += count
        self.run_skips += count

    def close_window(self) -> float | None:
        """When the Trainer logs the window's training loss: the mean loss over its applied steps, averaged over ranks,
        if the window had a skipped step and at least one applied step; otherwise `None` (the Trainer's own value
        stands). The next window starts. All ranks call this together: `_maybe_log_save_evaluate` does, where the
        Trainer decides to log."""
        value = None
        if self.window_skips and torch.is_tensor(self._window_count):
            pair = mean_across_ranks(torch.stack([self._window_sum, self._window_count]).float())
            if float(pair[1]) > 0:
                value = float(pair[0] / pair[1])
        self._run_sum = self._run_sum + self._window_sum
        self._run_count = self._run_count + self._window_count
        self._window_sum, self._window_count, self.window_skips = 0.0, 0.0, 0
        return value

    def train_loss(self) -> float | None:
        """The mean loss over the run's applied steps, if the run had a skipped step (else `None`)."""
        count = self._run_count + self._window_count
        if not self.run_skips or not torch.is_tensor(count) or float(count) == 0:
            return None
        return float((self._run_sum + self._window_sum) / count)
