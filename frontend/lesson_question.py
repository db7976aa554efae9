"""Predict, then reveal: the lesson card's question, its choices as buttons, and at its moment the answer.

A lesson step may ask a question (backend/events/questions.py). When the guide shows that step, the
choices are read from the run's state at that pause and drawn as large buttons, readable from the
back of a room; the lecturer clicks the audience's pick (or the show of hands' winner) and continues.
When the guide shows the step of the question's moment, the answer is read from that iteration's
events: the right choice is marked, and the pick with it (right or wrong). The moment's own highlight
(rings, the selected request, the outlined views) shows why. Nothing is asked of the server: the
question lives in this page only, so each viewer's card keeps its own pick.
"""

from __future__ import annotations

from typing import Any

from nicegui import ui

from kvscope.backend.events.moments import Moment
from kvscope.backend.events.questions import QUESTIONS, AnswerOption, Question, step_events
from kvscope.frontend.client import RunFeed

# A button's mark (also its data-mark): the sign before its label, and its Quasar colour (filled; none: outlined).
MARKS = {"right": ("✓ ", "positive"), "wrong": ("✗ ", "negative"), "picked": ("", "primary"), "": ("", None)}


class LessonQuestion:
    """The question asked by the step on screen, or waiting for its moment; hidden when there is none."""

    def __init__(self) -> None:
        self.question: Question | None = None
        self.choices: list[AnswerOption] = []
        self.pick: str | None = None
        self.locked = False  # the pick is final once the lesson moves on
        self.revealed = False
        self.buttons: dict[str, ui.button] = {}
        self.asked: dict[str, list[AnswerOption]] = {}  # each step's choices (by its text) as first asked
        with ui.column().classes("kv-question w-full").props("data-kv=lesson-question").mark("lesson-question") \
                as self.box:
            self.text = ui.label("").classes("kv-question-text").mark("question-text")
            self.row = ui.row().classes("kv-question-choices w-full")
            self.status = ui.label("").classes("kv-question-status").props("data-kv=question-status") \
                .mark("question-status")
        self.box.set_visibility(False)

    def on_step(self, step: dict[str, Any], feed: RunFeed, moment: Moment | None) -> None:
        """The guide shows `step` (at `moment`, or at the start): ask its question, or reveal the one waiting."""
        waiting = self.question is not None and not self.revealed
        if step.get("ask"):
            self._ask(step, feed)
        elif waiting and moment is not None and moment.kind == self.question.reveal:
            events = [*feed.past, *(entry.event for entry in feed.log)]  # the log alone may not reach back
            self._reveal(self.question.answer(step_events(events, moment.step)))
        elif waiting:  # a step in between: the pick is final, the answer still to come
            self._lock()
        else:
            self.question = None
            self.box.set_visibility(False)

    def reset(self) -> None:
        """No question: the card is shown again from its first step (a rewind, "previous")."""
        self.question, self.pick, self.locked, self.revealed = None, None, False, False
        self.box.set_visibility(False)

    def restore(self, pick: str | None) -> None:
        """The room's pick again, on a question asked again by a step before the one shown ("previous")."""
        if self.question is not None and pick in self.buttons:
            self._choose(pick)

    def _ask(self, step: dict[str, Any], feed: RunFeed) -> None:
        """Ask the step's question; asked again ("previous"), with the choices the state gave it the first
        time, not the later state's."""
        ask = step["ask"]
        self.question = QUESTIONS[ask["question"]]
        self.choices = self.asked.setdefault(step["text"], self.question.choices(feed.state))
        self.pick, self.locked, self.revealed = None, False, False
        self.text.set_text(ask.get("text") or self.question.text)
        self.row.clear()
        self.row.classes(remove="kv-question-locked")
        with self.row:
            self.buttons = {c.value: self._button(c) for c in self.choices}
        self.status.set_text("Click the room's pick (a show of hands), then continue.")
        self.box.set_visibility(True)

    def _button(self, choice: AnswerOption) -> ui.button:
        button = ui.button(choice.label, on_click=lambda c=choice: self._choose(c.value)) \
            .classes("kv-question-choice").props("outline no-caps size=lg data-kv=question-choice") \
            .mark(f"question-choice-{choice.value}")
        button.props.update({"data-choice": choice.value, "data-mark": ""})
        return button

    def _choose(self, value: str) -> None:
        if self.locked:
            return
        self.pick = value
        for v in self.buttons:
            self._mark(v, "picked" if v == value else "")
        self.status.set_text(f"Picked: {self._label(value)}. Continue, and the run will answer.")

    def _lock(self) -> None:
        self.locked = True  # not disabled: a disabled button greys out the marks the room should read
        self.row.classes(add="kv-question-locked")
        pick = f"the pick: {self._label(self.pick)}" if self.pick else "no pick entered"
        self.status.set_text(f"Waiting for the answer ({pick}).")

    def _reveal(self, answer: frozenset[str]) -> None:
        self._lock()
        self.revealed = True
        for value in self.buttons:
            self._mark(value, "right" if value in answer else "wrong" if value == self.pick else "")
        self.status.set_text(self._verdict(answer))

    def _verdict(self, answer: frozenset[str]) -> str:
        if not answer:
            return "The run did not answer it at this moment."
        right = " and ".join(self._label(v) for v in self.buttons if v in answer)
        right += " (together: each counts)" if len(answer) > 1 else ""
        if self.pick is None:
            return f"Answer: {right}."
        return f"Answer: {right}. The pick, {self._label(self.pick)}, was " + \
            ("right." if self.pick in answer else "wrong.")

    def _mark(self, value: str, mark: str) -> None:
        sign, color = MARKS[mark]
        button = self.buttons[value]
        button.set_text(sign + self._label(value))
        button.props["data-mark"] = mark
        button.props["color"] = color or "primary"
        button.props(remove="outline" if color else None, add=None if color else "outline")

    def _label(self, value: str) -> str:
        return next((c.label for c in self.choices if c.value == value), value)
