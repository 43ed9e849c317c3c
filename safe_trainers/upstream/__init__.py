"""The upstream names safe_trainers depends on (transformers' and TRL's internals, a few of torch's, PEFT's and
DeepSpeed's): one table (`table.py`), verified when the trainers are imported (`names.py`) and, for the hooks the NaN
guard needs, while training (`safe_trainers/trainer/hooks_ran.py`); `docs/design/upstream.md` is generated from it.

Imports nothing heavy: the checks import what they look in when they run.
"""

from .table import TOUCHPOINTS
from .touchpoint import Touchpoint

__all__ = ["TOUCHPOINTS", "Touchpoint"]
