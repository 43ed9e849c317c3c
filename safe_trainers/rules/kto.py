"""KTO rule (`kto.*`): a micro-batch that can hold the KL term's mismatched pairs."""

from __future__ import annotations

from .report import Finding
from .base import Rule


# KTO loss types without the KL term (TRL computes it from mismatched pairs inside each micro-batch).
KTO_KL_FREE_LOSSES = frozenset({"apo_zero_unpaired"})


def kto_uses_kl(loss_type: str | None) -> bool:
    """Whether TRL's KTO loss of this type estimates the KL term (from mismatched pairs inside each micro-batch)."""
    return (loss_type or "kto") not in KTO_KL_FREE_LOSSES


class KtoBatchAndLabels(Rule):
    """KTO with its KL term needs `per_device_train_batch_size` >= 2 (TRL refuses 1); one label kind is fine.

    What it changes:
        blocked only for `per_device_train_batch_size=1` with a loss that uses the KL term (every `loss_type` but
        `apo_zero_unpaired`); a dataset with one label kind is fine.

    Why:
        the KL term pairs mismatched examples inside a micro-batch, and TRL refuses a batch of 1
        ([OpenRLHF#326](https://github.com/OpenRLHF/OpenRLHF/issues/326)); TRL skips an empty side of the loss and
        averages with `nanmean`.

    Opt out:
        `safety_disable_rules=["kto.batch_and_labels"]`.
    """

    id = "kto.batch_and_labels"
    summary = "KTO with its KL term needs `per_device_train_batch_size` >= 2 (TRL refuses 1); one label kind is fine."
    trainers = frozenset({"kto"})
    rationale = "https://github.com/OpenRLHF/OpenRLHF/issues/326"

    def check(self, setup) -> Finding | None:
        # A dataset with only desirable (or only undesirable) examples trains: TRL skips the empty side of the loss
        # and averages with `nanmean`. Only a micro-batch too small for the KL pairs fails.
        args = setup.args
        batch = args.per_device_train_batch_size
        loss_type = getattr(args, "loss_type", None)
        if batch >= 2 or not kto_uses_kl(loss_type):
            return None
        return self.blocked(
            f"`per_device_train_batch_size={batch}` with `loss_type={loss_type or 'kto'!r}`: KTO estimates its KL "
            "term from mismatched pairs inside each micro-batch, which needs at least 2 examples, and TRL refuses a "
            "batch of 1. Use 2 or more (lower `gradient_accumulation_steps` to keep the effective batch), or "
            '`loss_type="apo_zero_unpaired"`, which has no KL term.'
        )
