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

from dataclasses import dataclass
from typing import Any

from nicegui import background_tasks, ui

from kvscope.backend.events.moments import VIEWS, Moment, step_views
from kvscope.frontend.client import Backend, BackendError, RunFeed
from kvscope.frontend.lesson_question import LessonQuestion
from kvscope.frontend.lesson_text import fill, header_of
from kvscope.frontend.palette import ring_color
from kvscope.frontend.selection import Selection
from kvscope.frontend.text import md_escape

TICK_S = 0.05
FOCUS_CLASS = "kv-focus"  # every view the step on screen names
SIGHT_CLASS = "kv-focus-now"  # the one of them brought into sight last (full screen takes it)
MOMENT_TITLES = {
    "start": "Before it starts", "queued": "First request queued", "slot_refilled": "A freed slot refilled",
    "prefill_chunk": "First prefill chunk", "prompt_cached": "First prompt cached",
    "first_decode": "First decode step", "block_added": "First block added while decoding",
    "prefix_hit": "First prefix hit", "share": "First shared block",
    "copy_on_write": "First copy-on-write", "cache_full": "The cache is full", "preempt": "First preemption",
    "recompute": "Its recompute", "fork": "First fork", "prune": "First prune",
    "draft_rejected": "First draft rejection", "first_token": "First token sampled",
    "mask_forced": "The grammar overrules the model", "one_token_allowed": "Only one token allowed",
    "request_finished": "First request finished", "bound_changed": "The bound changes",
    "kv_transfer": "First KV move", "finished": "Finished",
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


@dataclass(frozen=True)
class Stop:
    """A lesson step shown at a moment (None: at the start)."""

    index: int  # into the lesson's steps
    moment: Moment | None


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
        self.queue: list[Stop] = []  # steps whose moments came while one was on screen
        self.trail: list[Stop] = []  # the steps shown so far, in order: "previous" walks back along it
        self.ahead: list[Stop] = []  # steps walked back from, nearest first: "continue" shows them again
        self.epoch, self.seen = -1, 0  # the feed's snapshot this card is set up for; its moments handled
        self.drawn_ticks = 0  # ticks since the page first had the run's state (step 0 drawn after two)
        self.focused: list[ui.element] = []  # the cards of the views the step names, in its order
        self.in_sight = 0  # which of them was last brought into sight
        self.selected_before: str | None = None  # the page's own pick, given back when the step moves on
        self.selecting = False  # whether the step on screen selected its request
        with ui.card().classes("kv-card kv-lesson-card w-full").props("flat bordered").mark("lesson") as self.card:
            with ui.row().classes("w-full items-center no-wrap gap-2"):
                ui.label("Lesson").classes("kv-card-title")
                self.progress = ui.label("").classes("kv-caption").mark("lesson-progress") \
                    .props("data-kv=lesson-progress")
                ui.space()
                self.mode = ui.switch("lesson mode", value=False, on_change=self._on_mode).mark("lesson-mode") \
                    .tooltip("pause at each key moment the lesson explains")
            self.text = ui.markdown("").classes("kv-lesson-text w-full").mark("lesson-text") \
                .props("data-kv=lesson-text")
            self.question = LessonQuestion()  # a step's question, and at its moment the answer
            with ui.row().classes("w-full items-center gap-2 kv-lesson-buttons"):
                self.back = ui.button("previous", icon="undo", on_click=self.previous) \
                    .props("dense flat no-caps data-kv=lesson-previous").mark("lesson-previous") \
                    .tooltip("the previous moment's card and question again (←)")
                self.next_view = ui.button("next view", icon="south", on_click=self.show_next_view) \
                    .props("dense flat no-caps data-kv=lesson-next-view").mark("lesson-next-view") \
                    .tooltip("bring the next view this step names into sight (N)")
                ui.space()
                self.next = ui.button("continue", icon="play_arrow", on_click=self.resume) \
                    .props("dense data-kv=lesson-continue").mark("lesson-continue")
        self.card.set_visibility(False)
        for button in (self.back, self.next_view, self.next):
            button.set_visibility(False)
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
        if self.moment is None and not self.ahead and self.next.visible and feed.state.step >= 0:
            self.next.set_visibility(False)  # the start step's "continue": the run was started another way
        if self.moment is None and not self.ahead and self.queue:
            self._stop_at(self.queue.pop(0))

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
        elif self.feed.kind == "replay" and self.trail and self.trail[-1].moment is not None \
                and self.trail[-1].moment.step > state.step:
            self._rewind()  # sought back before the step on screen (a live run never goes back: a resync is not this)
        self.epoch = self.feed.epoch
        self.mode.set_value(self.feed.pacing.lesson)
        steps = lesson_steps(state.scenario)
        if steps != self.steps:
            self.steps = steps
            self.card.set_visibility(bool(steps))
            if steps and self.shown is None and steps[0]["at"] == "start" and not state.finished:
                self._present(Stop(0, None))
                # read it, then start (a run held only for its page starts by itself)
                self.next.set_visibility(state.step < 0 and self.feed.pacing.paused and not self.feed.start_when_drawn)
        last = self._step_at("finished")
        if state.finished and last is not None and last != self.shown and all(s.index != last for s in self.queue):
            self.queue.append(Stop(last, Moment("finished", state.step, 0, VIEWS["finished"])))  # opened after the end

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
                    and all(s.index != i for s in self.queue) and all(s.index != i for s in self.trail):
                self.queue.append(Stop(i, moment))

    def _stop_at(self, stop: Stop) -> None:
        self.moment = stop.moment
        self._present(stop)
        self.next.set_visibility(stop.moment.kind != "finished")  # nothing to continue to after the end
        if stop.moment.kind != "finished":  # the server paused it there; a replay records no control event
            self.feed.pacing.paused = True

    def _on_mode(self) -> None:
        """The switch: the run's lesson mode, for everyone watching it. Not a coroutine: NiceGUI runs an async
        handler as a later task, and a tick before it would set the switch back from the pacing not yet
        changed."""
        if self.feed.state is None or self.feed.pacing.lesson == self.mode.value:  # set from the run's own pacing
            return
        self.feed.pacing.lesson = self.mode.value  # at once: the tick keeps the switch on the pacing
        background_tasks.create(self._control("lesson", 1 if self.mode.value else 0), name="lesson mode")

    async def resume(self) -> None:
        """'continue': a step walked back from, the next step waiting at the same moment, or the run again."""
        if self.ahead:
            self._present(self.ahead.pop(0))
            self.next.set_visibility(bool(self.ahead) or self.moment is not None and self.moment.kind != "finished")
            return
        self._clear()
        self.moment = None
        self.next.set_visibility(False)
        if self.queue and self.queue[0].moment.step == self.feed.state.step:
            self._stop_at(self.queue.pop(0))
        elif not self.feed.state.finished:
            await self._control("resume")

    def previous(self) -> None:
        """'previous': the step before the one on screen, its highlights, and its question asked again.
        The views stay where the run is; "continue" walks forward again to where it was."""
        if len(self.trail) < 2:
            return
        self.ahead.insert(0, self.trail.pop())
        self._show_again(self.trail)
        self.next.set_visibility(True)

    def show_next_view(self) -> None:
        """Bring the next of the views the step names into sight (after the last, the first again)."""
        if self.focused:
            self.in_sight = (self.in_sight + 1) % len(self.focused)
            self._bring_into_sight()

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

    def _rewind(self) -> None:
        """The run is back before the step on screen (a replay sought back): the card shows the last step
        whose moment the run has reached again, with its question as it was then; the later ones will be
        paused at again."""
        step = self.feed.state.step
        kept = [s for s in self.trail if s.moment is None or s.moment.step <= step]
        self.queue, self.ahead, self.moment = [], [], None
        self._show_again(kept)
        self.next.set_visibility(False)

    def _show_again(self, stops: list[Stop]) -> None:
        """The card as it was when the last of `stops` was shown: the question asked, locked or revealed by
        the steps before it, in order, then that step (none: an empty card)."""
        self._clear()
        self.trail = []
        pick = self.question.pick
        self.question.reset()
        for stop in stops[:-1]:
            self.trail.append(stop)
            self.question.on_step(self.steps[stop.index], self.feed, stop.moment)
        if stops:
            if not self.steps[stops[-1].index].get("ask"):  # asked before the step shown: the room had picked
                self.question.restore(pick)
            self._present(stops[-1])
        else:
            self.shown = None
            self.text.set_content("")
            self.progress.set_text("")
            self.back.set_visibility(False)

    def _present(self, stop: Stop) -> None:
        """Show a step: its text, its question, the views it names outlined and the first brought into sight,
        the blocks of its moment ringed, and the request it is about selected."""
        self._clear()
        self.trail.append(stop)
        self.shown = stop.index
        step, moment = self.steps[stop.index], stop.moment
        where = f" (iteration {moment.step})" if moment is not None else ""
        self.progress.set_text(f"step {stop.index + 1} of {len(self.steps)} · {MOMENT_TITLES[step['at']]}{where}")
        self.text.set_content(md_escape(fill(step["text"], header_of(self.feed.state))))
        self.question.on_step(step, self.feed, moment)
        self.back.set_visibility(len(self.trail) > 1)
        self._highlight(step, moment)

    def _highlight(self, step: dict[str, Any], moment: Moment | None) -> None:
        blocks = self.views.get("blocks")
        if blocks is not None and moment is not None and moment.blocks:
            blocks.ring(list(moment.blocks), ring_color(moment.kind))
        views = step_views(step)
        # selected, the other requests fade: only for a step about one, or for a view that shows only one
        if moment is not None and moment.request_ids and (len(moment.request_ids) == 1 or "sampling" in views):
            self.selected_before, self.selecting = self.selection.request_id, True
            self.selection.select_request(moment.request_ids[0])
        cards = (card_of(self.views[name]) for name in views if name in self.views)
        self.focused = [card for card in cards if card is not None]
        for card in self.focused:
            card.classes(add=FOCUS_CLASS)
        self.in_sight = 0
        self.next_view.set_visibility(len(self.focused) > 1)
        if self.focused:  # the view the step talks about, scrolled into sight (it may be far below the fold)
            self._bring_into_sight()

    def _bring_into_sight(self) -> None:
        card = self.focused[self.in_sight]
        for other in self.focused:
            other.classes(remove=SIGHT_CLASS)
        card.classes(add=SIGHT_CLASS)
        self.card.client.run_javascript(f"kvscope.bringIntoSight('c{card.id}')")

    def _clear(self) -> None:
        blocks = self.views.get("blocks")
        if blocks is not None:
            blocks.ring([])
        for card in self.focused:
            card.classes(remove=f"{FOCUS_CLASS} {SIGHT_CLASS}")
        self.focused = []
        if self.selecting:
            self.selection.select_request(self.selected_before)
        self.selected_before, self.selecting = None, False
