"""The collapse watch: warn-only `collapse` events when a GRPO or RLOO run goes bad without a NaN (entropy or reward
spread falling to nothing, KL running away, completions shrinking), judged on the metrics TRL already computes
against the run's own recent steps (`signals.py`: what, `watch.py`: when). See `docs/collapse.md`."""

from .signals import DEFAULT_SIGNALS, SIGNAL_NAMES, SIGNALS, Signal, Verdict, judge

__all__ = ["DEFAULT_SIGNALS", "SIGNAL_NAMES", "SIGNALS", "Signal", "Verdict", "judge"]
