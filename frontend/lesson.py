"""Lesson mode: the run pauses by itself at each key moment its lesson explains, and says why.

A scenario's lesson is a list of steps (backend/scenario.py: LessonStep), each shown at the start or
at a moment kind (backend/events/moments.py). The pausing is the server's (backend/server/runs.py):
a run in lesson mode holds itself after the iteration in which such a moment happened, so it stops
exactly there at any speed, unpaced included. The run's feed finds the same moments with the same
pure MomentFinder (frontend/client.py); when a moment a step waits for completes, the guide rings
the blocks concerned in the block pool, selects the request concerned (so every view highlights its
row), outlines the views to look at, and shows the step's text. "Continue" resumes. The switch turns
the run's lesson mode on and off for everyone watching it. The `finished` step shows at the end
whatever the switch, also on a page opened after the end.

A run started from the dashboard waits paused at step 0 for its page (RunFeed.start_when_drawn): the
guide resumes it once the page has drawn that step, unless a lesson's first step holds it for "continue".
"""

from __future__ import annotations

from typing import Any

from nicegui import ui

from kvscope.backend.events.moments import VIEWS, Moment
from kvscope.frontend.client import Backend, BackendError, RunFeed
from kvscope.frontend.lesson_question import LessonQuestion
from kvscope.frontend.selection import Selection
from kvscope.frontend.text import md_escape

TICK_S = 0.05
FOCUS_CLASS = "kv-focus"
MOMENT_TITLES = {
    "start": "Before it starts", "queued": "First request queued", "slot_refilled": "A freed slot refilled",
    "prefill_chunk": "First prefill chunk", "prompt_cached": "First prompt cached",
    "first_decode": "First decode step", "block_added": "First block added while decoding",
    "prefix_hit": "First prefix hit", "share": "First shared block",
    "copy_on_write": "First copy-on-write", "cache_full": "The cache is full", "preempt": "First preemption",
    "recompute": "Its recompute", "fork": "First fork", "prune": "First prune",
    "draft_rejected": "First draft rejection", "first_token": "First token sampled",
    "mask_forced": "The grammar overrules the model", "one_token_allowed": "Only one token allowed",
    "request_finished": "First request finished", "bound_changed": "The bound changes", "finished": "Finished",
}  # fmt: skip


def lesson_steps(scenario: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The lesson's steps from a scenario dict (the header's, or the API's): [{at, text}, ...]."""
    lesson = (scenario or {}).get("lesson") or []
    if isinstance(lesson, str):  # a trace recorded before lessons had steps
        return [{"at": "start", "text": lesson}] if lesson.strip() else []
    return list(lesson)


def lesson_markdown(steps: list[dict[str, Any]]) -> str:
    """The steps as a numbered Markdown list, each with the moment it waits for."""
    return "\n".join(f"{i}. *{MOMENT_TITLES.get(s['at'], s['at'])}.* {md_escape(s['text'])}"
                     for i, s in enumerate(steps, 1))


def card_of(view: object) -> ui.element | None:
    """The view's card: the nearest `kv-card` above any of its elements."""
    for value in vars(view).values():
        element = value if isinstance(value, ui.element) else None
        while element is not None:
            if "kv-card" in element.classes:
                return element
            element = element.parent_slot.parent if element.parent_slot else None
    return None


class LessonGuide:
    """One run's lesson card; `views` are the column's views by name (RunColumn.views)."""

    def __init__(self, backend: Backend, feed: RunFeed, views: dict[str, object], selection: Selection) -> None:
        self.backend, self.feed, self.views, self.selection = backend, feed, views, selection
        self.steps: list[dict[str, Any]] = []
        self.shown: int | None = None  # index into steps of the step on screen
        self.moment: Moment | None = None  # the moment the run is paused at
        self.queue: list[tuple[int, Moment]] = []  # steps whose moments came while one was on screen
        self.epoch, self.seen = -1, 0  # the feed's snapshot this card is set up for; its moments handled
        self.drawn_ticks = 0  # ticks since the page first had the run's state (step 0 drawn after two)
        self.focused: list[ui.element] = []
        self.selected_before: str | None = None
        with ui.card().classes("kv-card kv-lesson-card w-full").props("flat bordered").mark("lesson") as self.card:
            with ui.row().classes("w-full items-center no-wrap gap-2"):
                ui.label("Lesson").classes("kv-card-title")
                self.progress = ui.label("").classes("kv-caption").mark("lesson-progress") \
                    .props("data-kv=lesson-progress")
                ui.space()
                self.mode = ui.switch("lesson mode", value=False, on_change=self._on_mode).mark("lesson-mode") \
                    .tooltip("pause at each key moment the lesson explains")
                self.next = ui.button("continue", icon="play_arrow", on_click=self.resume) \
                    .props("dense data-kv=lesson-continue").mark("lesson-continue")
            self.text = ui.markdown("").classes("kv-lesson-text w-full").mark("lesson-text") \
                .props("data-kv=lesson-text")
            self.question = LessonQuestion()  # a step's question, and at its moment the answer
        self.card.set_visibility(False)
        self.next.set_visibility(False)
        ui.timer(TICK_S, self.tick)

    @property
    def paused_at(self) -> str | None:
        """The kind of moment lesson mode holds the run at, or None."""
        return self.moment.kind if self.moment is not None else None

    async def tick(self) -> None:
        feed = self.feed
        if feed.state is None:
            return
        if feed.epoch != self.epoch:
            self._join()
        for moment in feed.moments[self.seen:]:
            self._on_moment(moment)
        self.seen = len(feed.moments)
        if self.mode.value != feed.pacing.lesson:  # another viewer flipped it
            self.mode.set_value(feed.pacing.lesson)
        await self._start_when_drawn()
        if self.moment is None and self.next.visible and feed.state.step >= 0:
            self.next.set_visibility(False)  # the start step's "continue": the run was started another way
        if self.moment is None and self.queue:
            await self._stop_at(*self.queue.pop(0))

    async def _start_when_drawn(self) -> None:
        """Resume a run held at step 0 for its page, once this page has drawn it. Views tick at 20 Hz like
        the guide, and their timers run only once the browser is connected: two ticks later they drew it."""
        feed = self.feed
        if not feed.start_when_drawn:
            return
        self.drawn_ticks += 1
        if self.drawn_ticks >= 2:
            feed.start_when_drawn = False  # the first page does it; a second tab finds it done
            if feed.state.step < 0 and feed.pacing.paused:
                await self._control("resume")

    def _join(self) -> None:
        self._name_cards()
        state = self.feed.state
        if self.epoch < 0:  # this page joins now: moments past are not paused at, but those the run is held at
            moments, pacing = self.feed.moments, self.feed.pacing
            held = pacing.lesson and pacing.paused and state.step >= 0
            self.seen = next((i for i, m in enumerate(moments) if held and m.step == state.step), len(moments))
        self.epoch = self.feed.epoch
        self.mode.set_value(self.feed.pacing.lesson)
        steps = lesson_steps(state.scenario)
        if steps != self.steps:
            self.steps = steps
            self.card.set_visibility(bool(steps))
            if steps and self.shown is None and steps[0]["at"] == "start":
                self._show(0)
                # read it, then start (a run held only for its page starts by itself)
                self.next.set_visibility(state.step < 0 and self.feed.pacing.paused and not self.feed.start_when_drawn)
        last = self._step_at("finished")
        if state.finished and last is not None and last != self.shown and all(i != last for i, _ in self.queue):
            self.queue.append((last, Moment("finished", state.step, 0, VIEWS["finished"])))  # opened after the end

    def _name_cards(self) -> None:
        """Each view's card says which view it is (`data-view`), for the names moments give views."""
        for name, view in self.views.items():
            card = card_of(view)
            if card is not None and card.props.get("data-view") != name:
                card.props(f"data-view={name}")

    def _step_at(self, kind: str) -> int | None:
        return next((i for i, step in enumerate(self.steps) if step["at"] == kind), None)

    def _on_moment(self, moment: Moment) -> None:
        for i, step in enumerate(self.steps):  # the conclusion shows with lesson mode off too
            if step["at"] == moment.kind and (self.mode.value or moment.kind == "finished") \
                    and all(j != i for j, _ in self.queue):
                self.queue.append((i, moment))

    async def _stop_at(self, index: int, moment: Moment) -> None:
        self.moment = moment
        self._show(index)
        self._highlight(moment)
        self.next.set_visibility(True)
        if moment.kind != "finished":  # the server paused it there; a replay records no control event
            self.feed.pacing.paused = True

    async def _on_mode(self) -> None:
        """The switch: the run's lesson mode, for everyone watching it."""
        if self.feed.state is None or self.feed.pacing.lesson == self.mode.value:  # set from the run's own pacing
            return
        self.feed.pacing.lesson = self.mode.value  # at once: the tick keeps the switch on the pacing
        await self._control("lesson", 1 if self.mode.value else 0)

    async def resume(self) -> None:
        """'continue': the next step waiting at the same moment, or the run again."""
        self._clear()
        self.moment = None
        self.next.set_visibility(False)
        if self.queue and self.queue[0][1].step == self.feed.state.step:
            await self._stop_at(*self.queue.pop(0))
        elif not self.feed.state.finished:
            await self._control("resume")

    async def _control(self, action: str, value: float | None = None) -> None:
        try:
            await self.backend.control(self.feed.run_id, action, value)
        except BackendError as e:
            ui.notify(f"lesson: {e}", type="warning")
            return
        pacing = self.feed.pacing  # replays record no control events: mirror it now
        if action == "lesson":
            pacing.lesson = bool(value)
        else:
            pacing.paused = action == "pause"

    def _show(self, index: int | None) -> None:
        self.shown = index
        if index is None:
            self.text.set_content("")
            return
        step = self.steps[index]
        where = f" (iteration {self.moment.step})" if self.moment is not None else ""
        self.progress.set_text(f"step {index + 1} of {len(self.steps)} · {MOMENT_TITLES[step['at']]}{where}")
        self.text.set_content(md_escape(step["text"]))
        self.question.on_step(step, self.feed, self.moment)

    def _highlight(self, moment: Moment) -> None:
        blocks = self.views.get("blocks")
        if blocks is not None and moment.blocks:
            blocks.ring(list(moment.blocks))
        if moment.request_ids:
            self.selected_before = self.selection.request_id
            self.selection.select_request(moment.request_ids[0])
        for name in moment.views:
            card = card_of(self.views[name]) if name in self.views else None
            if card is not None:
                card.classes(add=FOCUS_CLASS)
                self.focused.append(card)
        if self.focused:  # the view the step talks about, scrolled into sight (it may be far below the fold)
            self.card.client.run_javascript(f"kvscope.bringIntoSight('c{self.focused[0].id}')")

    def _clear(self) -> None:
        blocks = self.views.get("blocks")
        if blocks is not None:
            blocks.ring([])
        for card in self.focused:
            card.classes(remove=FOCUS_CLASS)
        self.focused = []
        if self.moment is not None and self.moment.request_ids:
            self.selection.select_request(self.selected_before)
