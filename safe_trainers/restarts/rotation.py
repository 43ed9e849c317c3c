"""`save_total_limit` rotation that never deletes a run's own newest state in favour of an earlier run's checkpoints.

transformers' rotation sorts every `checkpoint-N` of `output_dir` by step and deletes the lowest. In an `output_dir`
reused by a new run, an earlier run's checkpoints numbered above the new run's are kept and the new run's own are
deleted: the new run's `checkpoint-0` and `checkpoint-4` go, the earlier run's 8 and 12 stay, and a rollback from disk
(`nan_rollback_from="checkpoint"`) or a restart has nothing of its own left to go back to. Here, when `checkpoint-N`
is published, only the checkpoints numbered at or below N take part (those of this run's timeline so far, and any
earlier run's lower-numbered ones, as in transformers); higher-numbered ones are left alone and not counted. The newest
(the one just published) and the best model's are always kept, as in transformers.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable

from ..runtime.checkpoint_dirs import checkpoint_step, checkpoints

logger = logging.getLogger("safe_trainers")


def rotation_victims(steps: Iterable[int], newest: int, limit: int | None, keep: Iterable[int] = ()) -> list[int]:
    """The checkpoint steps to delete, oldest first, so that at most `limit` of those numbered at or below `newest`
    remain; the highest of them and the steps in `keep` (the best model's) are never deleted. `limit` `None` or <= 0:
    none."""
    if not limit or limit <= 0:
        return []
    counted = sorted(s for s in set(steps) if s <= newest)
    if not counted:
        return []
    protected = {counted[-1]} | (set(keep) & set(counted))
    excess = len(counted) - max(limit, len(protected))
    return [s for s in counted if s not in protected][: max(excess, 0)]


def rotate_up_to(run_dir: str, newest: int, limit: int | None, best_model_checkpoint: str | None) -> list[str]:
    """Delete the checkpoints [`rotation_victims`] names in `run_dir`; return their paths."""
    found = {checkpoint_step(path): path for path in checkpoints(run_dir)}
    keep = []
    if best_model_checkpoint and os.path.normpath(os.path.dirname(best_model_checkpoint)) == os.path.normpath(run_dir):
        keep.append(checkpoint_step(best_model_checkpoint))
    removed = []
    for step in rotation_victims(found, newest, limit, [s for s in keep if s is not None]):
        logger.info(f"Deleting older checkpoint [{found[step]}] due to args.save_total_limit")
        shutil.rmtree(found[step], ignore_errors=True)
        removed.append(found[step])
    return removed
