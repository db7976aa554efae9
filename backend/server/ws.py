"""WS /ws/runs/{run_id}: one snapshot, then every event, for any number of watchers.

The worker thread only appends to each watcher's bounded queue and, when the queue was empty,
wakes this coroutine through the event loop. A watcher that cannot keep up is never waited for: its
queue is dropped and the next thing it receives is a fresh snapshot (`type: snapshot`).
"""

from __future__ import annotations

import asyncio

from litestar import WebSocket, websocket
from litestar.params import FromPath
from litestar.exceptions import WebSocketDisconnect

from backend.server.runs import ServedRun


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
    watcher = run.attach(lambda: loop.call_soon_threadsafe(ready.set))
    closed = asyncio.create_task(_wait_closed(socket))
    try:
        while not closed.done():
            snapshot, events = run.take(watcher)
            if snapshot is not None:
                await socket.send_json(snapshot)
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
