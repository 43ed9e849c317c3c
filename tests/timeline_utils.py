"""Draw a run's timeline the way `safe-trainers timeline` does and read back what it shows: the summary and the
markers of the HTML page."""

from __future__ import annotations

import os

from safe_trainers.timeline import read_run, summary
from safe_trainers.timeline.picture import markers_in_html, save_html, save_png

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def drawn_timeline(output_dir: str, where: str) -> tuple[str, set[tuple[str, int]]]:
    """Draw the timeline of the run in `output_dir` into `where/timeline.{png,html}`; its summary and the `(kind,
    step)` of the markers its HTML page shows."""
    run = read_run(output_dir)
    text = summary(run)
    prefix = os.path.join(where, "timeline")
    save_png(run, prefix + ".png")
    save_html(run, prefix + ".html", text)
    with open(prefix + ".png", "rb") as f:
        assert f.read(8) == PNG_MAGIC
    with open(prefix + ".html", encoding="utf-8") as f:
        return text, markers_in_html(f.read())
