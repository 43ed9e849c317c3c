"""Logging rule: a NaN loss must show as NaN in the logs."""

from __future__ import annotations

from dataclasses import replace

from .report import Change, Finding
from .base import Rule


class ShowNonFinite(Rule):
    """`logging_nan_inf_filter` is turned off so a NaN loss is logged as NaN instead of being hidden.

    What it changes:
        `logging_nan_inf_filter=True` becomes `False`.

    Why:
        with the filter a NaN loss is logged as the recent average, often 0.0, hiding a diverged run
        ([trl#6702](https://github.com/huggingface/trl/issues/6702))

    Opt out:
        `safety_disable_rules=["logging.show_nonfinite"]`.
    """

    id = "logging.show_nonfinite"
    summary = "`logging_nan_inf_filter` is turned off so a NaN loss is logged as NaN instead of being hidden."
    rationale = "https://github.com/huggingface/trl/issues/6702"

    def check(self, setup) -> Finding | None:
        if not getattr(setup.args, "logging_nan_inf_filter", False):
            return None
        finding = self.fixed(
            "`logging_nan_inf_filter=True` replaces a NaN or Inf loss by the recent average (often 0.0) in the logs, "
            "hiding a diverged run. NaN losses are now logged as NaN.",
            Change("args.logging_nan_inf_filter", True, False),
        )
        # transformers' default: changed for everyone, so it says nothing about the user's config.
        return replace(finding, library_default=not setup.user_set("logging_nan_inf_filter"))
