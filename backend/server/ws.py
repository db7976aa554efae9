"""WS /ws/runs/{run_id}: one snapshot, then every event, for any number of watchers.

The worker thread only appends to each watcher's bounded queue and, when the queue was empty,
wakes this coroutine through the event loop. A watcher that cannot keep up is never waited for: its
queue is dropped and the next thing it receives is a fresh snapshot (`type: snapshot`).

Viewers share one send budget (events a second, all of them together; a snapshot counts one per
SNAPSHOT_BYTES_PER_EVENT of its JSON, about what it costs to build and send), so that many viewers, or
slow ones, cannot take the event loop (and the GIL) from the engine and the OpenAI routes: past
the budget viewers fall behind and resync. A run takes at most --max-viewers (close code 4429).
"""

from __future__ import annotations

import asyncio

from litestar import WebSocket, websocket
from litestar.params import FromPath
from litestar.exceptions import WebSocketDisconnect

from kvscope.backend.server.run_errors import RunBusy
from kvscope.backend.server.runs import ServedRun

MAX_BURST_S = 0.25  # the budget saved up while idle
SNAPSHOT_BYTES_PER_EVENT = 4096  # encoding 4 KiB of JSON costs about what sending one event does


class SendBudget:
    """A token bucket shared by every viewer of the server: at most `rate` events a second in all."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.next_free = 0.0  # the loop's clock when the budget is spent up to

    def reserve(self, events: int) -> float:
        """Book `events` (first come, first served); returns the seconds to wait before sending them."""
        now = asyncio.get_running_loop().time()
        start = max(self.next_free, now - MAX_BURST_S)
        self.next_free = start + events / self.rate
        return self.next_free - now


@websocket("/ws/runs/{run_id:str}")
async def run_socket(socket: WebSocket, run_id: FromPath[str]) -> None:
    run: ServedRun | None = socket.app.state.manager.get(run_id)
    await socket.accept()
    if run is None:
        await socket.send_json({"type": "error", "error": f"no run {run_id!r}"})
        await socket.close(code=4404)
        return
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    try:
        watcher = run.attach(lambda: loop.call_soon_threadsafe(ready.set),
                             wants_past=socket.query_params.get("past") == "1")
    except RunBusy as e:
        await socket.send_json({"type": "error", "error": str(e)})
        await socket.close(code=4429)
        return
    budget: SendBudget = socket.app.state.viewer_budget
    closed = asyncio.create_task(_wait_closed(socket))
    try:
        while not closed.done():
            snapshot, events = run.take(watcher, max_events=64)
            cost = len(events) + (len(snapshot) // SNAPSHOT_BYTES_PER_EVENT + 1 if snapshot is not None else 0)
            delay = budget.reserve(cost) if cost else 0.0
            if delay > 0:
                await asyncio.wait({closed}, timeout=delay)  # a viewer that leaves meanwhile is not waited for
                if closed.done():
                    break
            if snapshot is not None:
                await socket.send_text(snapshot)
            for line in events:
                await socket.send_text(line)
            if snapshot is None and not events:
                ready.clear()
                if watcher.queue or watcher.needs_snapshot:
                    continue  # arrived between take() and clear()
                waiter = asyncio.ensure_future(ready.wait())
                await asyncio.wait({closed, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        run.detach(watcher)
        closed.cancel()


async def _wait_closed(socket: WebSocket) -> None:
    """Reads (and ignores) client messages until the client goes away."""
    try:
        while True:
            await socket.receive_data(mode="text")
    except (WebSocketDisconnect, RuntimeError, OSError):
        return
