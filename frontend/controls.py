"""Controls of the watched run(s): play, pause, step, speed, seek (replays) and live prompts.

With two runs side by side every control acts on both, so they stay in step.
"""

from __future__ import annotations

from nicegui import ui

from kvscope.frontend.client import Backend, BackendError, RunFeed
from kvscope.frontend.new_run import SPEEDS
from kvscope.frontend.views.live_text import LiveText


class RunControls:
    def __init__(self, backend: Backend, feeds: list[RunFeed]) -> None:
        self.backend = backend
        self.feeds = feeds
        self.speed = 4.0
        self.num_steps: int | None = None  # replays only: the length of the trace
        with ui.row().classes("items-center gap-1 no-wrap kv-controls"):
            self.play = ui.button(icon="play_arrow", on_click=self.toggle).props("round dense color=positive") \
                .mark("play").props("data-kv=play").tooltip("play / pause")
            ui.button(icon="skip_next", on_click=self.step).props("round dense flat color=white") \
                .mark("step").props("data-kv=step").tooltip("pause and run exactly one iteration")
            self.speed_select = ui.select(SPEEDS, value=4.0, on_change=self.set_speed) \
                .props("dense dark options-dense") \
                .classes("w-28").mark("speed").tooltip("iterations per second")
            self.seek = ui.slider(min=0, max=1, value=0).props("dense label color=white").classes("w-40") \
                .on("change", self._on_seek).mark("seek")
            self.seek.set_visibility(False)
            self.status = LiveText().classes("kv-status").mark("run-status").props("data-kv=run-status")
        ui.timer(0.25, self.refresh)

    @property
    def run_ids(self) -> list[str]:
        return [f.run_id for f in self.feeds]

    def load(self, runs: dict[str, dict]) -> None:
        """Pick up the speed, and the length of a replay (for the seek slider), from the run list."""
        first = runs.get(self.run_ids[0]) if self.run_ids else None
        if first:
            self.speed = first.get("speed", 4.0)
            self.speed_select.set_value(self.speed if self.speed in SPEEDS else 4.0)
        steps = [runs[r]["num_steps"] for r in self.run_ids if r in runs and "num_steps" in runs[r]]
        if steps:
            self.num_steps = max(steps)
            self.seek.props(f"max={max(self.num_steps - 1, 1)}")
            self.seek.set_visibility(True)

    async def _all(self, action: str, value: float | None = None) -> None:
        for run_id in self.run_ids:
            try:
                await self.backend.control(run_id, action, value)
            except BackendError as e:
                ui.notify(f"{run_id}: {e}", type="warning")

    async def toggle(self) -> None:
        paused = self.paused()
        await self._all("resume" if paused else "pause")
        for feed in self.feeds:
            feed.pacing.paused = not paused  # replays record no control events: mirror it now
        self.refresh()

    async def pause(self) -> None:
        await self._all("pause")

    async def resume(self) -> None:
        await self._all("resume")

    async def step(self) -> None:
        await self._all("step", 1)
        for feed in self.feeds:
            feed.pacing.paused = True

    async def set_speed(self) -> None:
        value = self.speed_select.value
        if value is None or value == self.speed:
            return
        self.speed = float(value)
        await self._all("speed", self.speed)

    async def _on_seek(self) -> None:
        await self._all("seek", float(self.seek.value))

    def paused(self) -> bool:
        known = [f.pacing for f in self.feeds if f.state is not None]  # before its snapshot, a default
        return bool(known) and all(p.paused for p in known)

    def refresh(self) -> None:
        icon = "play_arrow" if self.paused() or self._finished() else "pause"
        if self.play.props.get("icon") != icon:
            self.play.props(f"icon={icon}")
        text = " | ".join(_status(f) for f in self.feeds)
        self.status.set(text)
        if self.seek.visible and self.feeds and self.feeds[0].state is not None:
            step = max(self.feeds[0].state.step, 0)
            if step != self.seek.value:
                self.seek.set_value(step)

    def _finished(self) -> bool:
        return all(f.state is not None and f.state.finished for f in self.feeds)


def _status(feed: RunFeed) -> str:
    s = feed.state
    if s is None:
        return f"{feed.run_id}: {feed.status}"
    if s.failed:  # the reason, from its error event: a dead run must not look like one still going
        return f"{feed.run_id} · step {max(s.step, 0)} · failed · {s.error}"
    mode = "finished" if s.finished else ("paused" if feed.pacing.paused else "running")
    return (f"{feed.run_id} · step {max(s.step, 0)} · {mode} · {len(s.running)} running · {len(s.waiting)} waiting"
            + ("" if feed.status == "live" else f" · {feed.status}"))


class PromptBox:
    """Type a prompt and add it to the live run (POST /api/runs/{id}/requests).

    With "chat" on, the text is a user message that the server writes with the run's model's chat
    template; the switch starts on for a model that has one (an instruct model expects its template)."""

    def __init__(self, backend: Backend, feed: RunFeed) -> None:
        self.backend = backend
        self.feed = feed
        self.chat = False
        with ui.row().classes("items-end gap-2 w-full no-wrap"):
            self.prompt = ui.input("add a prompt to this run", placeholder="ROMEO:\n").classes("grow") \
                .props("dense clearable data-kv=prompt").mark("prompt").on("keydown.enter", self.send)
            self.chat_switch = ui.switch("chat").bind_value(self, "chat").props("dense").mark("prompt-chat") \
                .tooltip("send it as a user message, written with the model's chat template")
            self.max_tokens = ui.number("max tokens", value=32, min=1, max=1024, precision=0).classes("w-24") \
                .props("dense").mark("prompt-max-tokens")
            self.temperature = ui.number("T", value=0.8, min=0, max=2, step=0.1).classes("w-16").props("dense") \
                .mark("prompt-temperature")
            ui.button("add", icon="send", on_click=self.send).props("dense").mark("prompt-send")
        ui.timer(0.0, self.load_chat_default, once=True)

    async def load_chat_default(self) -> None:
        """Chat on when the run's model has a chat template (GET /api/runs says so)."""
        try:
            runs = await self.backend.runs()
        except BackendError:
            return  # off, as for a model without a template; the user can still switch it on
        run = next((r for r in runs if r["run_id"] == self.feed.run_id), {})
        self.chat_switch.set_value(bool(run.get("chat_template")))

    async def send(self) -> str | None:
        text = (self.prompt.value or "").replace("\\n", "\n")
        if not text.strip():
            ui.notify("Type a prompt first", type="warning")
            return None
        try:
            rid = await self.backend.add_request(self.feed.run_id, text, int(self.max_tokens.value or 32),
                                                 {"temperature": float(self.temperature.value or 0.0)}, self.chat)
        except BackendError as e:
            ui.notify(f"Not added: {e}", type="negative", multi_line=True)
            return None
        ui.notify(f"added {rid}", type="positive")
        self.prompt.set_value("")
        return rid
