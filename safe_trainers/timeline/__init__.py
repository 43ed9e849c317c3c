"""A picture of a run from the files it writes (`safe-trainers timeline OUTPUT_DIR`): the metrics over steps with a
marker at each event of the guard and the restarts, the wall time of each process of the run and the gaps between
them, and a text summary with the goodput.

- `run_files.py` reads what the run wrote (the log history, the event log, the step record);
- `markers.py` turns events into markers (a table of kinds);
- `goodput.py` computes the processes' spans and the goodput (pure);
- `summary.py` writes the text summary (pure);
- `picture.py` draws the PNG and the self-contained HTML (matplotlib, the optional extra `[timeline]`).
"""

from ..restarts.progress import Span
from .goodput import Goodput, goodput, process_spans
from .markers import MARKER_KINDS, Marker, markers
from .run_files import RunFiles, read_run
from .summary import summary


__all__ = [
    "MARKER_KINDS", "Goodput", "Marker", "RunFiles", "Span", "goodput", "markers", "process_spans", "read_run",
    "summary",
]  # fmt: skip
