"""The spike detector: a window of recent applied steps, kept on the device, that judges each step before its update.

A step *spikes* when its loss or its (pre-clip) gradient norm lies more than `factor` standard deviations above the
mean of the window (a one-sided z-score, as OLMo-core's skip-step optimizers judge it). The judgement is a device
flag, folded into the step's skip flag where the non-finite skip happens (`flags.py`), so a spike is skipped
before its update with no host synchronisation. The values judged are the same on every rank (the gradient norm is
reduced over the world, the loss is the largest rank's, agreed in the guard's one all-reduce), so every rank keeps the
same window and skips alike.

Only applied steps with finite values and a non-zero gradient norm enter the window: skipped steps (non-finite or
spiking) never do, nor steps with no learning signal (a GRPO batch whose groups all have equal rewards has a loss
and gradient of exactly 0; a history of zeros would make every informative step a spike). No step is judged before
`warmup` steps have entered the window. The deviation is measured against `max(std, RELATIVE_FLOOR * |mean|)`, so a
nearly constant history does not turn ordinary noise into a huge score.

A run of spiking steps long enough to roll back restarts the window ([`SpikeWindow.restart`]): the detector warms
up again on the values the run now trains at, so a lasting change of level costs one rollback, not the run.

The window is the guard's saved state: [`SpikeWindow.history`] reads it back (oldest first) when a checkpoint is
written, and a resumed run starts from it, so its first steps are judged against the run's own history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

RELATIVE_FLOOR = 0.05  # the smallest deviation considered, as a fraction of |mean|
SERIES = ("loss", "grad_norm")


@dataclass(frozen=True)
class SpikeSettings:
    """How spikes are judged (from the `nan_spike_*` settings).

    Args:
        factor (`float`): the threshold in standard deviations above the window's mean (`0` disables).
        window (`int`): how many recent applied steps the mean and standard deviation cover.
        warmup (`int`): steps that must have entered the window before any step is judged.
    """

    factor: float
    window: int = 64
    warmup: int = 16

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    @classmethod
    def from_settings(cls, settings: Any) -> "SpikeSettings":
        return cls(settings.nan_spike_factor, settings.nan_spike_window, settings.nan_spike_warmup)


class SpikeWindow:
    """A ring buffer of the last `settings.window` applied steps' loss and gradient norm, on the device.

    Args:
        settings ([`SpikeSettings`]): the threshold, window length and warm-up.
        history (`dict`, *optional*): a saved window ([`SpikeWindow.history`]) to start from.
    """

    def __init__(self, settings: SpikeSettings, history: dict[str, list[float]] | None = None):
        self.settings = settings
        self._history = history
        self.values: torch.Tensor | None = None  # [2, window]: row 0 the losses, row 1 the gradient norms
        self.count: torch.Tensor | None = None  # steps entered so far (int64); the next one's slot: count % window
        self._slots: torch.Tensor | None = None

    def _allocate(self, device: torch.device) -> None:
        width = self.settings.window
        self.values = torch.zeros((len(SERIES), width), dtype=torch.float32, device=device)
        self._slots = torch.arange(width, device=device)
        rows = [list(self._history.get(name, []))[-width:] for name in SERIES] if self._history else [[], []]
        entered = min(len(rows[0]), len(rows[1]))
        if entered:
            saved = torch.tensor([row[len(row) - entered :] for row in rows], dtype=torch.float32)
            self.values[:, :entered] = saved.to(device)
        self.count = torch.tensor(entered, dtype=torch.int64, device=device)
        self._history = None

    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor, applied: torch.Tensor) -> torch.Tensor:
        """The device flag of a spike for a step whose (agreed) `loss` and `grad_norm` are given; `applied`: the
        step's update is not skipped for another reason. A step that does not spike and is applied with finite,
        informative values enters the window. No host synchronisation."""
        if self.values is None or self.values.device != loss.device:
            self._allocate(loss.device)
        point = torch.stack([loss.float(), grad_norm.float().to(loss.device)])
        informative = applied & torch.isfinite(point).all() & (point[1] != 0)
        filled = self.count.clamp(max=self.settings.window)
        in_window = self._slots < filled
        size = filled.clamp(min=1).float()
        mean = torch.where(in_window, self.values, 0.0).sum(dim=1) / size
        spread = torch.where(in_window, self.values - mean[:, None], 0.0)
        std = (spread.square().sum(dim=1) / size).sqrt()
        scale = torch.maximum(std, RELATIVE_FLOOR * mean.abs())
        excess = torch.where(scale > 0, (point - mean) / torch.where(scale > 0, scale, 1.0), 0.0)
        warm = self.count >= self.settings.warmup
        spike = informative & warm & (excess > self.settings.factor).any()
        enters = informative & ~spike
        slot = self._slots == self.count % self.settings.window
        self.values.copy_(torch.where(enters & slot, point[:, None], self.values))
        self.count.add_(enters.to(torch.int64))
        return spike

    def restart(self) -> None:
        """Forget the window and warm up again (a device write, no host synchronisation). After a run of spiking
        steps has rolled back, the level the run kept spiking at may be its own new level (a new data mix, a
        rescaled reward): a window that holds only the old level would reject every later step."""
        self._history = None
        if self.count is not None:
            self.count.zero_()

    def history(self) -> dict[str, list[float]] | None:
        """The window's values, oldest first, as the checkpoint keeps them (a host read: only when saving)."""
        if self.values is None:  # not used yet: the saved window, as this window keeps it
            if self._history is None:
                return None
            return {name: list(self._history.get(name, []))[-self.settings.window :] for name in SERIES}
        entered = int(self.count)
        width = self.settings.window
        order = torch.arange(entered - min(entered, width), entered) % width
        values = self.values.cpu()[:, order]
        return {name: values[i].tolist() for i, name in enumerate(SERIES)}


__all__ = ["RELATIVE_FLOOR", "SERIES", "SpikeSettings", "SpikeWindow"]
