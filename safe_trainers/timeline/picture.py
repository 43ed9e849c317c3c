"""The timeline drawn with matplotlib (the optional extra `safe-trainers[timeline]`): loss, gradient norm and learning
rate over steps with a vertical marker at each event, and the run's processes over wall time with the gaps between
them; saved as a PNG and as one self-contained HTML file (the picture inlined as SVG, the summary, a table of the
events). Each marker carries an id, `marker-<kind>-<step>-<panel>-<n>`, in the SVG, and each table row its step and
kind, so that tools (and tests) read the markers back from the HTML."""

from __future__ import annotations

import html
import io
import re
from typing import Any

from ..restarts.progress import Span
from .goodput import process_spans
from .markers import MARKER_KINDS, Marker, markers
from .run_files import RunFiles

# The panels over steps: the log-history key drawn, and its axis label.
STEP_PANELS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"),
    ("grad_norm", "gradient norm"),
    ("learning_rate", "learning rate"),
)
INSTALL_HINT = 'the picture needs matplotlib: `pip install "safe-trainers[timeline]"` (the summary above needs nothing)'


def plotting_available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw(run: RunFiles) -> Any:
    """The timeline's matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib.figure import Figure

    found = markers(run.events)
    spans = process_spans(run.record)
    figure = Figure(figsize=(11, 2.3 * (len(STEP_PANELS) + 1)), layout="constrained")
    axes = figure.subplots(len(STEP_PANELS) + 1, 1)
    for ax, (key, label) in zip(axes, STEP_PANELS):
        _step_panel(ax, run.log_history, key, label, found)
    axes[len(STEP_PANELS) - 1].set_xlabel("optimizer step")
    for ax in axes[1 : len(STEP_PANELS)]:
        ax.sharex(axes[0])
    _process_panel(axes[-1], spans, found)
    axes[-1].set_title(f"the processes of {run.output_dir}", fontsize="small")
    handles = [_legend_handle(kind) for kind in MARKER_KINDS if any(m.kind == kind for m in found)]
    if handles:
        figure.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 6), fontsize="small")
    return figure


def save_png(run: RunFiles, path: str) -> None:
    draw(run).savefig(path, dpi=100)


def save_html(run: RunFiles, path: str, text: str) -> None:
    """Write the self-contained HTML page: `text` (the summary), the picture as inline SVG, the events' table."""
    buffer = io.StringIO()
    draw(run).savefig(buffer, format="svg")
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg") :]  # inline: without the XML declaration and doctype
    rows = "\n".join(_event_row(m) for m in markers(run.events))
    page = PAGE.format(
        title=html.escape(run.output_dir), summary=html.escape(text), svg=svg,
        rows=rows or '<tr><td colspan="3">no events</td></tr>',
    )  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def markers_in_html(page: str) -> set[tuple[str, int]]:
    """The `(kind, step)` of every marker drawn in a timeline page (what [`save_html`] wrote)."""
    return {(kind, int(step)) for kind, step in re.findall(r'id="marker-([a-z_]+)-(\d+)-', page)}


def _step_panel(ax: Any, history: list[dict[str, Any]], key: str, label: str, found: list[Marker]) -> None:
    points = [(e["step"], e[key]) for e in history if isinstance(e.get(key), (int, float))]
    if points:
        steps, values = zip(*points)
        ax.plot(steps, values, color="#333333", linewidth=1.2, marker="." if len(points) < 60 else None)
        finite = [v for v in values if v == v and abs(v) != float("inf")]
        if key == "grad_norm" and finite and min(finite) > 0 and max(finite) / min(finite) > 100:
            ax.set_yscale("log")  # a norm that spans decades
    else:
        ax.text(0.5, 0.5, f"no `{key}` logged yet", transform=ax.transAxes, ha="center", va="center", color="gray")
    for n, (marker, x) in enumerate(zip(found, spread(found))):
        style = MARKER_KINDS[marker.kind]
        ax.axvline(x, color=style.color, linewidth=1.5, alpha=0.85, gid=f"marker-{marker.kind}-{marker.step}-{key}-{n}")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


def spread(found: list[Marker], width: float = 0.12) -> list[float]:
    """Where each marker is drawn: at its step, markers sharing a step side by side (`width` steps apart)."""
    at: dict[int, int] = {}
    for marker in found:
        at[marker.step] = at.get(marker.step, 0) + 1
    seen: dict[int, int] = {}
    xs = []
    for marker in found:
        n = seen[marker.step] = seen.get(marker.step, -1) + 1
        xs.append(marker.step + (n - (at[marker.step] - 1) / 2) * width)
    return xs


def _process_panel(ax: Any, spans: list[Span], found: list[Marker]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("wall time since the run began (s)")
    ax.set_ylabel("step")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if not spans:
        ax.text(0.5, 0.5, "no wall times in the step record", transform=ax.transAxes, ha="center", color="gray")
        return
    start = min(s.began for s in spans)
    for n, marker in enumerate(m for m in found if m.time is not None):
        ax.plot([marker.time - start], [marker.step], marker="o", color=MARKER_KINDS[marker.kind].color,
                gid=f"event-{marker.kind}-{marker.step}-wall-{n}")  # fmt: skip
    for span in spans:
        ax.plot([span.began - start, span.ended - start], [span.first_step, span.last_step], linewidth=2,
                gid=f"process-{span.attempt}", label=f"process {span.attempt}")  # fmt: skip
    for n, (span, after) in enumerate(zip(spans, spans[1:])):
        ax.axvspan(span.ended - start, after.began - start, color="#cccccc", alpha=0.6, gid=f"gap-{n}")
    ax.legend(fontsize="small", loc="upper left")
    ax.grid(alpha=0.3)


def _legend_handle(kind: str) -> Any:
    from matplotlib.lines import Line2D

    return Line2D([], [], color=MARKER_KINDS[kind].color, linewidth=2, label=MARKER_KINDS[kind].label)


def _event_row(marker: Marker) -> str:
    return (
        f'<tr data-step="{marker.step}" data-kind="{marker.kind}"><td>{marker.step}</td>'
        f"<td>{html.escape(MARKER_KINDS[marker.kind].label)}</td><td>{html.escape(marker.text)}</td></tr>"
    )


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>safe-trainers timeline: {title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
pre {{ background: #f5f5f5; padding: 0.8em; overflow-x: auto; }}
table {{ border-collapse: collapse; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 0.25em 0.8em; text-align: left; }}
svg {{ max-width: 100%; height: auto; }}
</style>
</head>
<body>
<h1>Run timeline</h1>
<pre>{summary}</pre>
{svg}
<h2>Events</h2>
<table>
<tr><th>step</th><th>kind</th><th>what happened</th></tr>
{rows}
</table>
</body>
</html>
"""


__all__ = [
    "INSTALL_HINT", "STEP_PANELS", "draw", "markers_in_html", "plotting_available", "save_html", "save_png", "spread",
]  # fmt: skip
