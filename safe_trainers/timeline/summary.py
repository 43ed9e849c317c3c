"""The timeline's text summary: where the run is, its goodput, its events by kind and its processes."""

from __future__ import annotations

import time
from collections import defaultdict

from ..restarts.progress import Span
from .goodput import Goodput, goodput, process_spans, worked
from .markers import MARKER_KINDS, Marker, markers
from .run_files import RunFiles

MAX_STEPS_LISTED = 12


def summary(run: RunFiles, now: float | None = None) -> str:
    """The text summary of `run` (`now`: the time to say how long ago the last record was written)."""
    spans = process_spans(run.record)
    found = markers(run.events)
    lines = [f"Run in {run.output_dir}", f"  {state_line(run, now if now is not None else time.time())}"]
    lines += [f"  {line}" for line in time_lines(goodput(spans, run.events), len(worked(spans)))]
    lines.append("  events: " + (event_line(found) if found else "none"))
    lines += [f"  {line}" for line in process_lines(spans)]
    if run.log_source is None:
        lines.append("  no `trainer_state.json` yet (written with each checkpoint): no metrics to draw")
    return "\n".join(lines)


def state_line(run: RunFiles, now: float) -> str:
    record = run.record
    if record is None:
        return f"state: no step record (a run without the guard, or an older version); last step seen {run.last_step}"
    if record.finished:
        result = record.history.result or {}
        return f"state: finished at step {result.get('global_step', record.step)} (`train()` returned)"
    where = {"step": "inside step", "compile": "compiling in step", "between": "after step"}[record.phase]
    ago = f", {now - record.time:.0f} s ago" if record.time else ""
    return f"state: running or stopped, not finished: last record {where} {record.step}{ago}"


def time_lines(found: Goodput, processes: int) -> list[str]:
    if found.ratio is None:
        return ["time: not recorded (no step record with wall times: `nan_guard=False`, or an older version's record)"]
    gaps = f", {sum(found.gaps):.1f} s between them" if found.gaps else ""
    lost = []
    if found.not_applied_steps:
        lost.append(f"{found.not_applied_steps} step(s) not applied or rolled back by the guard")
    if found.redone_steps:
        lost.append(f"{found.redone_steps} step(s) redone after a restart")
    return [
        f"wall time {found.wall:.1f} s in {processes} process(es){gaps}; {found.in_steps:.1f} s inside optimizer "
        f"steps, {found.productive:.1f} s of them productive",
        f"goodput {100 * found.ratio:.1f}% (productive step time / wall time)"
        + (f"; lost: {', '.join(lost)}" if lost else ""),
    ]


def event_line(found: list[Marker]) -> str:
    steps: dict[str, list[int]] = defaultdict(list)
    for marker in found:
        steps[marker.kind].append(marker.step)
    parts = []
    for kind in MARKER_KINDS:  # in the table's order
        if kind in steps:
            listed = ", ".join(str(s) for s in steps[kind][:MAX_STEPS_LISTED])
            more = ", ..." if len(steps[kind]) > MAX_STEPS_LISTED else ""
            parts.append(f"{MARKER_KINDS[kind].label} x{len(steps[kind])} (step {listed}{more})")
    return "; ".join(parts)


def process_lines(spans: list[Span]) -> list[str]:
    lines = []
    for index, span in enumerate(spans):
        gap = f", {span.began - spans[index - 1].ended:.1f} s after the previous one" if index else ""
        clock = time.strftime("%H:%M:%S", time.localtime(span.began))
        end = "finished" if span.finished else "to its last record"
        lines.append(
            f"process {span.attempt}: steps {span.first_step}-{span.last_step}, from {clock}{gap}; ran "
            f"{span.ended - span.began:.1f} s ({end}), {span.step_seconds:.1f} s of it in steps"
        )
    return lines


__all__ = ["summary"]
