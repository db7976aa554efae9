"""A lesson's steps as pictures: each step's view at the moment the lesson pauses for it, the moment's
blocks ringed as on the page, the step's title above and its text below.

What a step shows is the page's choice, read from the same places: the moment is the first of its kind
in the events (backend/events/moments.py, the finder the live guide uses), the views are those the step
names (`step_views`), the first the exporter can draw, and the ring's colour is palette.ring_color's.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure

from kvscope.backend.events.moments import Moment, find_moments, step_views
from kvscope.frontend.export.blocks import draw_blocks
from kvscope.frontend.export.draw import DRAW
from kvscope.frontend.export.figure import SUBTITLE_PT, TITLE_PT, Size
from kvscope.frontend.export.options import SLIDE_SIZE, ExportError
from kvscope.frontend.export.replayed import Event, replay
from kvscope.frontend.lesson import MOMENT_TITLES, lesson_steps
from kvscope.frontend.lesson_text import fill
from kvscope.frontend.palette import ring_color

CAPTION_CHARS = 150  # a line of 16 pt text across a 19.2-inch page
CAPTION_PT = SUBTITLE_PT + 1


@dataclass(frozen=True)
class LessonPage:
    """One lesson step and the moment the run paused for it."""

    number: int  # 1-based, as the lesson card counts
    count: int  # steps in the lesson
    step: dict[str, Any]  # the scenario's step: at, text, views, ask
    moment: Moment | None  # None for the start, or a moment this run never reached

    @property
    def title(self) -> str:
        """'step 2 of 4 · First copy-on-write (iteration 12)': the lesson card's own words."""
        where = f" (iteration {self.moment.step})" if self.moment is not None else ""
        return f"step {self.number} of {self.count} · {MOMENT_TITLES.get(self.step['at'], self.step['at'])}{where}"

    @property
    def view(self) -> str | None:
        """The view its picture shows: the first the step names that the exporter draws, else the block pool
        (the timeline at the end, where the pool is all free); None without a moment to show."""
        if self.moment is None:
            return None
        fallback = "timeline" if self.moment.kind == "finished" else "blocks"
        return next((v for v in step_views(self.step) if v in DRAW), fallback)


def header_event(events: list[Event]) -> Event:
    return events[0] if events and events[0].get("type") == "header" else {}


def header_scenario(events: list[Event]) -> dict[str, Any]:
    return header_event(events).get("scenario") or {}


def first_moments(events: list[Event]) -> dict[str, Moment]:
    """Each kind's first moment: the one lesson mode pauses at."""
    firsts: dict[str, Moment] = {}
    for moment in find_moments(events):
        firsts.setdefault(moment.kind, moment)
    return firsts


def lesson_pages(events: list[Event]) -> list[LessonPage]:
    """The run's lesson, step by step, each with the first moment of its kind in the events; each text filled
    from the run's header (a compare pair's two traces read their own numbers)."""
    steps, firsts = lesson_steps(header_scenario(events)), first_moments(events)
    header = header_event(events)
    return [LessonPage(i, len(steps), {**step, "text": fill(step["text"], header)}, firsts.get(step["at"]))
            for i, step in enumerate(steps, 1)]


def moment_page(events: list[Event], kind: str) -> LessonPage:
    """The lesson step that pauses at `kind`; ExportError when the lesson has none or the run never got there."""
    pages = lesson_pages(events)
    page = next((p for p in pages if p.step["at"] == kind), None)
    if page is None:
        steps = ", ".join(p.step["at"] for p in pages) or "none"
        raise ExportError("moment", f"the lesson has no step at {kind!r} (its steps: {steps})")
    if page.moment is None:
        raise ExportError("moment", f"the run never reached {kind!r}")
    return page


def draw_page(events: list[Event], page: LessonPage, size: Size = SLIDE_SIZE) -> Figure:
    """The page's view as of the moment's iteration, its blocks ringed when the view is the block pool."""
    assert page.moment is not None and page.view is not None, "a page without a moment has no picture"
    run = replay(events, page.moment.step)
    if page.view == "blocks":
        fig = draw_blocks(run, size=size, ring=(page.moment.blocks, ring_color(page.moment.kind)))
    else:
        fig = DRAW[page.view](run, size=size)
    fig.suptitle(f"{run.scenario} · {page.title}", fontsize=TITLE_PT, fontweight="bold")
    fig.supxlabel(textwrap.fill(page.step["text"], CAPTION_CHARS), x=0.01, ha="left", fontsize=CAPTION_PT)
    return fig
