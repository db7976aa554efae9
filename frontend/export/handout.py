"""The lesson handout: one HTML file a student keeps, made from a finished run.

The scenario and what it is about, then each lesson step in order: its title and text, its question
with the run's own choices and answer (backend/events/questions.py, as the lesson card reveals it), and
its picture (lesson.py: the step's view at its moment). Self-contained on purpose: the pictures are PNG
data URIs and the style is inline, so the file opens offline, mails as one attachment and prints.
Every text from the trace is HTML-escaped: a scenario is user input.
"""

from __future__ import annotations

import base64
import io
from html import escape
from pathlib import Path

from kvscope.backend.events.questions import QUESTIONS, step_events
from kvscope.backend.events.state import RunState
from kvscope.frontend.export.figure import Size, slide_style
from kvscope.frontend.export.gif import Progress
from kvscope.frontend.export.lesson import LessonPage, draw_page, first_moments, header_scenario, lesson_pages
from kvscope.frontend.export.options import SLIDE_SIZE, ExportError
from kvscope.frontend.export.replayed import Event

STYLE = """body{font:17px/1.5 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#111827}
h1{margin-bottom:.2rem}.meta{color:#6b7280}section{margin:2.5rem 0;break-inside:avoid}
h2{font-size:1.2rem;border-bottom:2px solid #e5e7eb;padding-bottom:.2rem}img{width:100%;height:auto}
.ask{background:#f3f4f6;border-left:4px solid #6366f1;padding:.5rem 1rem}.ask p{margin:.3rem 0}"""


def state_at(events: list[Event], step: int) -> RunState:
    """The run as of the end of `step` (-1: before its first iteration), as the lesson card read it."""
    state = RunState(max_iterations=2)
    for event in events:
        if event.get("step", -1) > step:
            break
        state.apply(event)
    return state


def question_html(events: list[Event], page: LessonPage) -> str:
    """The step's question, the choices the room had, and the run's answer; '' when it asks none."""
    ask = page.step.get("ask")
    if not ask:
        return ""
    question = QUESTIONS[ask["question"]]
    choices = question.choices(state_at(events, page.moment.step if page.moment else -1))
    reveal = first_moments(events).get(question.reveal)
    right = question.answer(step_events(events, reveal.step)) if reveal else frozenset()
    labels = {c.value: c.label for c in choices}
    answer = " · ".join(labels.get(v, v) for v in sorted(right)) or "not answered in this run"
    return (f'<div class="ask"><p><b>Question:</b> {escape(ask.get("text") or question.text)}</p>'
            f'<p><b>Choices:</b> {escape(" · ".join(labels.values()))}</p>'
            f'<p><b>Answer:</b> {escape(answer)}</p></div>')


def picture_html(events: list[Event], page: LessonPage, size: Size) -> str:
    """The step's picture as an <img> with a PNG data URI; '' for a step without a moment."""
    if page.moment is None:
        return ""
    buffer = io.BytesIO()
    fig = draw_page(events, page, size)
    fig.savefig(buffer, format="png", dpi=fig.dpi)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{escape(f"{page.view} at {page.title}")}">'


def page_html(events: list[Event], page: LessonPage, size: Size) -> str:
    return (f"<section><h2>{escape(page.title)}</h2><p>{escape(page.step['text'])}</p>"
            f"{question_html(events, page)}{picture_html(events, page, size)}</section>")


def handout_html(events: list[Event], size: Size = SLIDE_SIZE, progress: Progress | None = None) -> str:
    """The whole handout; ExportError when the run's scenario has no lesson."""
    scenario, pages = header_scenario(events), lesson_pages(events)
    if not pages:
        raise ExportError("trace", "the run's scenario has no lesson to make a handout of")
    name = scenario.get("name") or "kvscope run"
    model = Path(str(events[0].get("model", {}).get("name", "?"))).name
    sections = []
    with slide_style():
        for index, page in enumerate(pages):
            sections.append(page_html(events, page, size))
            if progress is not None:
                progress((index + 1) / (len(pages) + 1))  # writing the file is the last share
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(name)} · kvscope lesson'
            f"</title><style>{STYLE}</style></head><body><h1>{escape(name)}</h1>"
            f'<p class="meta">a kvscope lesson · model {escape(model)}</p>'
            f"<p>{escape(scenario.get('description') or '')}</p>{''.join(sections)}</body></html>\n")


def write_handout(events: list[Event], out_path: Path, size: Size = SLIDE_SIZE,
                  progress: Progress | None = None) -> Path:
    if progress is not None:
        progress(0.0)
    out_path.write_text(handout_html(events, size, progress), encoding="utf-8")
    if progress is not None:
        progress(1.0)
    return out_path
