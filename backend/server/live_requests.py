"""The API's requests on an engine run: each call's listener, and the adds on their way to the worker.

An API call adds its request through the run, then waits on a listener that the engine's outputs
for it reach (on the worker thread: the engine's `stream_outputs`). When the run fails every listener
is told RunFailed at once, rather than left to its timeout. The open-ended API run forgets a finished
request after the step that finished it, so that its engine's memory stays bounded whatever its age.

Nothing here locks: the run changes `adds_pending` under its lock (the room check reads it beside the
engine's count of waiting requests); the rest is the worker thread's, and `fail_all`'s once the worker stopped.
"""

from __future__ import annotations

from collections.abc import Callable

from kvscope.backend.engine.request_output import Finished, RequestOutput
from kvscope.backend.server.run_errors import RunBusy, RunFailed

Listener = Callable[[RequestOutput | RunFailed], None]


class LiveRequests:
    """The listeners of one run's live requests (request id -> callback), and the room left to wait."""

    def __init__(self, run_id: str, max_waiting: int | None, forgets_finished: bool) -> None:
        self.run_id = run_id
        self.max_waiting = max_waiting
        self.forgets_finished = forgets_finished  # the open-ended run: its engine forgets what finished
        self.listeners: dict[str, Listener] = {}
        self.adds_pending = 0  # add_request calls on their way to the worker thread
        self.finished_ids: list[str] = []  # finished this step: the engine forgets them after it
        self._counter = 0

    def check_room(self, waiting: int, count: int) -> None:
        """RunBusy if `waiting` requests and the adds on their way leave no room for `count` more."""
        waiting += self.adds_pending
        limit = self.max_waiting
        if limit is not None and waiting + count > limit:
            raise RunBusy(f"run {self.run_id!r} has {waiting} requests waiting, at most {limit} may wait "
                          "(--max-waiting); try again shortly")

    def listen(self, request_id: str | None, listener: Listener | None) -> str:
        """The request's id (its own, or the next `live-N`), with its listener registered."""
        self._counter += 1
        rid = request_id or f"live-{self._counter}"
        if listener is not None:
            self.listeners[rid] = listener
        return rid

    def drop(self, request_id: str) -> None:
        """The engine refused the request: nobody listens for it."""
        self.listeners.pop(request_id, None)

    def deliver(self, output: RequestOutput) -> None:
        """The engine's answer for one request, to the API call waiting for it."""
        listener = self.listeners.get(output.request_id)
        if listener is not None:
            listener(output)
        if isinstance(output, Finished):
            self.listeners.pop(output.request_id, None)
            if self.forgets_finished:
                self.finished_ids.append(output.request_id)

    def take_finished(self) -> list[str]:
        """The requests the engine may forget now, after the step that finished them."""
        finished, self.finished_ids = self.finished_ids, []
        return finished

    def fail_all(self, failed: RunFailed) -> None:
        """Every waiting API call gets its answer now, not a timeout."""
        for listener in list(self.listeners.values()):
            listener(failed)
