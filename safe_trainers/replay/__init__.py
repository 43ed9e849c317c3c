"""Replay bundles: a faulted step written to `output_dir/nan_replay/step-N/` (`bundle.py`: the layout, the size bound,
the rotation) and replayed on the CPU from the checkpoint before it (`rerun.py`), for `safe-trainers replay`
(docs/replay.md). What a bundle holds is taken from a trainer by `trainer/replay_bundles.py`."""

from .bundle import REPLAY_DIR, bundle_dir, bundle_steps, fit, read_bundle, rotate_bundles, write_bundle

__all__ = ["REPLAY_DIR", "bundle_dir", "bundle_steps", "fit", "read_bundle", "rotate_bundles", "write_bundle"]
