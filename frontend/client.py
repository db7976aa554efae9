"""The dashboard's only link to the backend: HTTP for commands, one websocket per watched run.

`FeedHub` keeps one `RunFeed` per run in the NiceGUI process, shared by every browser tab: it
reads `WS /ws/runs/{id}` (a `type: snapshot` message, then events; a snapshot may come again at any
time when the server resyncs us, or a replay seeks), keeps a `RunRecord` (the reducer's `RunState` and the
`RunHistory` of the past, fed by one apply), the run's `Pacing` (paused, speed, lesson mode: the
server's run's, not the reducer's), the lesson moments found so far, and a short log of recent events
stamped with their receive time. Views read these on their own timers; they never see the websocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
import orjson  # a NiceGUI dependency
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from kvscope.backend.events.history import RunHistory
from kvscope.backend.events.moments import Moment, MomentFinder
from kvscope.backend.events.pacing import Pacing
from kvscope.backend.events.record import RunRecord
from kvscope.backend.events.state import SERVER_FIELDS, RunState

logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per API call on the console

LOG_SIZE = 8192  # recent events kept for deltas; a view further behind redraws fully
RELEASE_GRACE_S = 20.0  # keep a feed this long after its last tab closed (a page reload reuses it)
RECONNECT_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 2.0, 5.0, 5.0, 5.0, 10.0, 10.0)  # then the feed gives up
HEALTHY_S = 30.0  # a connection up this long (and delivering) was healthy: its drop gets every retry again


class BackendError(Exception):
    """The backend refused a command (its 4xx message) or could not be reached."""


class Backend:
    """The backend's REST API (docs/api.md), as the dashboard uses it."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    @property
    def ws_base(self) -> str:
        return "ws" + self.base_url.removeprefix("http")

    async def request(self, method: str, path: str, body: dict | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            # A client per call: the dashboard sends a few commands a minute, and a client bound to
            # one event loop would break the test harness, which runs a fresh loop per test.
            async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, headers=headers) as http:
                response = await http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise BackendError(f"backend at {self.base_url} unreachable: {e}") from None
        if response.status_code >= 400:
            raise BackendError(_error_message(response))
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    async def scenarios(self) -> list[dict]:
        return await self.request("GET", "/api/scenarios")

    async def models(self) -> list[dict]:
        return await self.request("GET", "/api/models")

    async def scenario(self, name: str) -> dict:
        return await self.request("GET", f"/api/scenarios/{name}")

    async def runs(self) -> list[dict]:
        return await self.request("GET", "/api/runs")

    async def start_run(self, scenario: str | dict, overrides: dict | None = None, speed: float = 4.0,
                        paused: bool = False, lesson: bool = False) -> str:
        """`lesson`: the server pauses the run at each moment its lesson explains (lesson mode)."""
        body = {"scenario": scenario, "overrides": overrides or {}, "speed": speed, "paused": paused, "lesson": lesson}
        return (await self.request("POST", "/api/runs", body))["run_id"]

    async def start_replay(self, trace_text: str, speed: float = 4.0, paused: bool = True,
                           lesson: bool = False) -> str:
        body = {"trace": trace_text, "speed": speed, "paused": paused, "lesson": lesson}
        return (await self.request("POST", "/api/runs", body))["run_id"]

    async def control(self, run_id: str, action: str, value: float | None = None) -> dict:
        return await self.request("POST", f"/api/runs/{run_id}/control", {"action": action, "value": value})

    async def add_request(self, run_id: str, prompt: str, max_tokens: int, sampling: dict, chat: bool = False) -> str:
        """`chat`: the prompt is a user message, which the server writes with the model's chat template."""
        text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        body = {**text, "max_tokens": max_tokens, "sampling": sampling}
        return (await self.request("POST", f"/api/runs/{run_id}/requests", body))["request_id"]

    async def trace(self, run_id: str) -> str:
        return await self.request("GET", f"/api/runs/{run_id}/trace")

    async def token_dist(self, run_id: str, request_id: str, seq_id: int, position: int) -> dict | None:
        """One token's whole raw distribution, or None when the run does not keep it (a replay, evicted)."""
        try:
            return await self.request("GET", f"/api/runs/{run_id}/dist?" + urlencode(
                {"request_id": request_id, "seq_id": seq_id, "position": position}))
        except BackendError:
            return None

    # -- the run library (docs/api.md) ------------------------------------------------------------

    async def library(self) -> dict:
        return await self.request("GET", "/api/library")

    async def rename_saved(self, entry_id: str, name: str) -> dict:
        return await self.request("PATCH", f"/api/library/{entry_id}", {"name": name})

    async def delete_saved(self, entry_id: str) -> None:
        await self.request("DELETE", f"/api/library/{entry_id}")

    async def open_saved(self, entry_id: str, speed: float = 4.0, paused: bool = True, lesson: bool = False) -> str:
        """A saved run as a new replay run; its id."""
        body = {"speed": speed, "paused": paused, "lesson": lesson}
        return (await self.request("POST", f"/api/library/{entry_id}/open", body))["run_id"]

    async def save_pair(self, run_ids: tuple[str, str], name: str | None = None) -> dict:
        """A compare page's two runs kept in the library as one pair."""
        return await self.request("POST", "/api/library/pairs", {"runs": list(run_ids), "name": name})

    async def delete_pair(self, pair_id: str) -> None:
        await self.request("DELETE", f"/api/library/pairs/{pair_id}")

    async def open_pair(self, pair_id: str, speed: float = 4.0, paused: bool = True,
                        lesson: bool = False) -> tuple[str, str]:
        """A saved pair's two runs as new replays; their ids, left then right."""
        body = {"speed": speed, "paused": paused, "lesson": lesson}
        left, right = (await self.request("POST", f"/api/library/pairs/{pair_id}/open", body))["run_ids"]
        return left, right


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    return str(body.get("error", body)) if isinstance(body, dict) else str(body)


@dataclass
class LogEntry:
    version: int
    recv_ms: float  # wall clock (ms) when this process received it: the latency probe's start
    event: dict


class RunFeed:
    """One run as this process knows it: reducer, history, and a log of recent events."""

    # Monotonic: a connection's lifetime must not jump with the wall clock. Tests put a fake here.
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, backend: Backend | None, run_id: str, log_size: int = LOG_SIZE) -> None:
        self.backend = backend
        self.run_id = run_id
        self.record: RunRecord | None = None  # None until the first snapshot
        self.past: list[dict] = []  # the latest snapshot's `past` (the events before it), when it had one
        # The server's run's, mirrored here; the controls set it at once too, as a replay records no
        # control event.
        self.pacing = Pacing()
        self.version = 0  # +1 per event applied
        self.epoch = 0  # +1 per snapshot: views redraw fully
        self.log: deque[LogEntry] = deque(maxlen=log_size)
        # Found here, as events arrive, and not by each page: a page's timer may fall behind the log,
        # and a resync skips events, but lesson mode holds the run at every moment (frontend/lesson.py).
        self.finder: MomentFinder | None = None
        self.moments: list[Moment] = []  # every moment found, in order
        self.last_recv_ms = 0.0
        self.kind = "run"
        self.status = "connecting"
        self.missing = False  # the server does not know this run (a wrong id, or the server restarted)
        self.watchers = 0
        # Started paused by this dashboard only so that no page opens mid-run: the first page to draw
        # its step 0 resumes it (frontend/lesson.py).
        self.start_when_drawn = False
        self.task: asyncio.Task | None = None
        self._release_handle: asyncio.TimerHandle | None = None

    # -- messages (pure: the tests feed these directly) --------------------------------------------

    def handle(self, message: dict, recv_ms: float | None = None) -> None:
        recv_ms = recv_ms if recv_ms is not None else time.time() * 1000.0
        self.last_recv_ms = recv_ms
        kind = message.get("type")
        if kind == "snapshot":
            self._resync(message)
        elif kind == "error" and "seq" not in message:  # the socket's own (no such run), not a run's error event
            self.missing = True
            self.status = f"error: {message.get('error')}"
        elif self.record is not None:
            self.record.apply(message)
            if kind == "control" and self.kind != "replay":  # a replay's are its trace's, not its own
                self.pacing.apply_control(message)
            self.version += 1
            self.log.append(LogEntry(self.version, recv_ms, message))
            self.moments += self.finder.feed(message)

    def _resync(self, snapshot: dict) -> None:
        self.record = resynced_record(snapshot)
        self.pacing = Pacing.from_snapshot(snapshot)
        self.past = snapshot.get("past") or []
        self.kind = snapshot.get("kind", "run")
        self._find_moments_from_snapshot()
        self.log.clear()
        self.epoch += 1
        self.version += 1
        self.status = "live"

    def _find_moments_from_snapshot(self) -> None:
        """A finder that has seen the run so far: fed the snapshot's past where it has one (a joining
        finder knows no prompt lengths of requests that arrived before the snapshot, so it took the
        first prefill chunk of a long prompt for a prompt wholly cached), else one joining mid-way.
        At a resync the past holds the events the server skipped because we fell behind: the moments
        they completed, and no other, are reported now, as if those events had come one by one, for
        lesson mode holds the run at them."""
        before, state = self.finder, self.record.state
        if not self.past:  # a long run resyncs without its past: the moments it skipped are lost
            self.finder = MomentFinder.joining(state.cache.get("num_blocks"), state.step, state.seq_request)
            if before is not None:
                self.finder.found |= before.found  # a first is reported once
            return
        self.finder = MomentFinder()
        found = [moment for event in self.past for moment in self.finder.feed(event)]
        self.moments += [moment for moment in found if before is None or moment.kind not in before.found]

    @property
    def state(self) -> RunState | None:
        return self.record.state if self.record is not None else None

    @property
    def history(self) -> RunHistory:
        return self.record.history if self.record is not None else RunHistory()  # no past before a snapshot

    def since(self, version: int) -> list[LogEntry] | None:
        """Events applied after `version`, oldest first; None when the log no longer reaches back."""
        if version >= self.version:
            return []
        if not self.log or self.log[0].version > version + 1:
            return None
        start = version + 1 - self.log[0].version
        return [self.log[i] for i in range(start, len(self.log))]

    # -- the websocket -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Read the run's websocket until cancelled. Retries are bounded, so a backend that is gone
        ends the feed within a minute; a healthy connection earns the whole budget back, so drops
        hours apart never add up to the end of a feed."""
        assert self.backend is not None
        url = f"{self.backend.ws_base}/ws/runs/{self.run_id}?past=1"  # the whole past: every view from step 0
        delays = (0.0, *RECONNECT_DELAYS_S)
        attempt = 0
        while attempt < len(delays):
            await asyncio.sleep(delays[attempt])
            healthy = await self._read_one_connection(url)
            if self.missing:
                return
            attempt = 1 if healthy else attempt + 1
        self.status = "disconnected: the backend stopped answering"

    async def _read_one_connection(self, url: str) -> bool:
        """Connect and read until the socket ends; whether it was healthy (it delivered messages and
        stayed up HEALTHY_S), so that its drop starts the reconnect budget afresh."""
        version, opened = self.version, None
        # No per-message deflate: on loopback it only costs CPU, on both ends of the socket.
        auth = {"Authorization": f"Bearer {self.backend.token}"} if self.backend.token else None
        try:
            async with connect(url, max_size=None, open_timeout=10, compression=None, additional_headers=auth) as ws:
                opened = self.clock()
                await self._read(ws)
        except (OSError, WebSocketException, asyncio.TimeoutError) as e:
            if not self.missing:  # the server closes with code 4404 after "no run": not worth a retry
                self.status = f"reconnecting ({e.__class__.__name__})"
        return opened is not None and self.version > version and self.clock() - opened >= HEALTHY_S

    async def _read(self, ws) -> None:
        count = 0
        async for raw in ws:
            self.handle(orjson.loads(raw))  # several times faster than json: thousands of events a second
            count += 1
            if count % 256 == 0:
                await asyncio.sleep(0)  # a burst must not starve the page timers on the same loop


def resynced_record(snapshot: dict) -> RunRecord:
    """The record a snapshot message starts from; a replay's carries its `past`, which makes it exact
    (the record a fresh replay stopped there builds), where a snapshot alone loses who waited when."""
    past = snapshot.get("past")
    if past is None:
        return RunRecord.from_snapshot(snapshot)
    record = RunRecord.from_events(past)
    for name in SERVER_FIELDS:  # what the server knows beyond those events (state.py's SERVERS_WORD)
        setattr(record.state, name, snapshot[name])
    return record


class FeedHub:
    """One feed per run id in this process; feeds live while a tab watches them (plus a grace)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.feeds: dict[str, RunFeed] = {}
        self.to_start: set[str] = set()  # runs to resume once a page has drawn their step 0

    def start_when_drawn(self, run_id: str) -> None:
        """The run (started paused) goes on when the first page watching it has drawn it from step 0."""
        self.to_start.add(run_id)

    def watch(self, run_id: str, kind: str | None = None) -> RunFeed:
        """The run's feed; `kind` (from the run list) is known before the first snapshot."""
        feed = self.feeds.get(run_id)
        if feed is None or (feed.task is not None and feed.task.done()):
            feed = self.feeds[run_id] = RunFeed(self.backend, run_id)
        feed.kind = kind or feed.kind
        if run_id in self.to_start:
            self.to_start.discard(run_id)
            feed.start_when_drawn = True
        feed.watchers += 1
        if feed._release_handle is not None:
            feed._release_handle.cancel()
            feed._release_handle = None
        if feed.task is None:
            feed.task = asyncio.get_running_loop().create_task(feed.run(), name=f"feed-{run_id}")
        return feed

    def watching(self, run_id: str) -> bool:
        """Whether this process follows the run live (it may outlast the server's list, which forgets old runs)."""
        feed = self.feeds.get(run_id)
        return feed is not None and not feed.missing and feed.task is not None and not feed.task.done()

    def release(self, feed: RunFeed) -> None:
        feed.watchers -= 1
        if feed.watchers <= 0:
            feed._release_handle = asyncio.get_running_loop().call_later(RELEASE_GRACE_S, self._close, feed)

    def _close(self, feed: RunFeed) -> None:
        if feed.watchers > 0:
            return
        if feed.task is not None:
            feed.task.cancel()
        if self.feeds.get(feed.run_id) is feed:
            del self.feeds[feed.run_id]

    def close_all(self) -> None:
        for feed in list(self.feeds.values()):
            if feed.task is not None:
                with contextlib.suppress(RuntimeError):
                    feed.task.cancel()
        self.feeds.clear()
