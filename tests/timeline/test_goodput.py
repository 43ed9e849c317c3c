"""The goodput and the processes' spans the timeline reports (`safe_trainers/timeline/goodput.py`): pure functions of
the step record and the event log, checked on hand-made runs and, for their invariants, on generated ones."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from safe_trainers.restarts.progress import History, Progress, Span
from safe_trainers.timeline.goodput import goodput, process_spans


def test_a_restarted_run_counts_the_steps_the_dead_process_ran_past_its_checkpoint_as_redone():
    # Process 0 ran steps 0-7 in 70 s and died; process 1 resumed at checkpoint-4 after a 20 s gap and finished at
    # step 10 (60 s in steps). Steps 5-7 of process 0 were redone; step 9's update was skipped by the guard.
    spans = [Span(0, 1000.0, 1080.0, 0, 7, 70.0), Span(1, 1100.0, 1170.0, 4, 10, 60.0, finished=True)]
    found = goodput(spans, [{"step": 9, "kind": "skip"}])
    assert (found.wall, found.in_steps, found.redone_steps, found.not_applied_steps) == (170.0, 130.0, 3, 1)
    assert found.gaps == [20.0]
    assert found.productive == 4 * 10.0 + 5 * 10.0  # process 0 kept steps 1-4; process 1 steps 5-10 but 9
    assert found.ratio == 90.0 / 170.0


def test_a_rollback_discards_the_steps_it_threw_away():
    spans = [Span(0, 0.0, 10.0, 0, 10, 10.0, finished=True)]
    events = [{"step": 6, "kind": "rollback", "discarded_steps": [5, 6]}, {"step": 6, "kind": "skip"}]
    assert goodput(spans, events).productive == 8.0


def test_the_spans_come_from_the_step_record():
    earlier = Span(0, 1000.0, 1080.0, 0, 7, 70.0)
    history = History(1, began=1100.0, first_step=4, spans=(earlier,))
    running = Progress(9, "step", "d", history, time=1150.0, step_seconds=40.0)
    assert process_spans(running) == [
        Span(0, 1000.0, 1080.0, 0, 7, 70.0),
        Span(1, 1100.0, 1150.0, 4, 8, 40.0),  # step 9 still running: 8 steps done
    ]
    assert process_spans(Progress(9, "between", "d", History(1))) == []  # an older record: no times


@st.composite
def runs(draw):
    """A run of 1-5 processes, each resuming at or before where the previous one got to, and its guard events."""
    spans, t, step = [], 0.0, 0
    for attempt in range(draw(st.integers(1, 5))):
        first = draw(st.integers(0, step)) if attempt else 0
        last = first + draw(st.integers(0, 20))
        began = t + draw(st.floats(0, 100))
        seconds = draw(st.floats(0, 100))
        ended = began + seconds + draw(st.floats(0, 50))
        spans.append(Span(attempt, began, ended, first, last, seconds))
        t, step = ended, last
    events = [{"step": s, "kind": k} for s, k in draw(st.lists(st.tuples(st.integers(1, 120), st.sampled_from(
        ["skip", "spike", "poison", "rollback", "preempt"]))))]  # fmt: skip
    return spans, events


@settings(max_examples=200, deadline=None)
@given(runs())
def test_goodput_invariants(run):
    spans, events = run
    found = goodput(spans, events)
    assert 0.0 <= found.productive <= found.in_steps + 1e-6
    assert found.ratio is None or 0.0 <= found.ratio <= 1.0 + 1e-9
    resumed = [min([s.last_step] + [n.first_step for n in spans[i + 1 :]]) for i, s in enumerate(spans)]
    assert found.redone_steps == sum(max(s.last_step - max(r, s.first_step), 0) for s, r in zip(spans, resumed))
    assert len(found.gaps) == len(spans) - 1
