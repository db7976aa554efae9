"""How a served run refuses a caller: RunError (a 400), RunFailed (its worker failed), RunClosed (a 409: it
finished and let its engine's ranks go), RunBusy (a 429), and how one request fails alone: RequestFailed
(a 400 naming the client's field).

Every part of a run raises these, and the routes catch them once at the edge; `describe_fault` and
`build_run` turn any other exception into words a client may read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from kvscope.backend.errors import KvscopeError

T = TypeVar("T")


class RunError(KvscopeError):
    """A control or request a run cannot take; becomes a 400 with this message."""


class RunFailed(RunError):
    """The run's worker failed (a fault, or no progress in time): it takes no request or control any more."""

    def __init__(self, run_id: str, cause: str) -> None:
        super().__init__(None, f"run {run_id!r} failed: {cause}")
        self.run_id, self.cause = run_id, cause


class RunClosed(RunError):
    """A finished run whose engine let go of what it held outside this process (a tensor-parallel engine's
    ranks, stopped as the run finished): it takes no new request. A 409 with the run's state: its state,
    not the request, is what is wrong, and a new run takes the request."""

    def __init__(self, run_id: str, state: str, why: str) -> None:
        super().__init__(None, f"run {run_id!r} is {state}: {why}")
        self.run_id, self.state = run_id, state


class RunBusy(Exception):
    """A run (or the server) is full for now: a 429 with Retry-After, the client may try again."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailed(Exception):
    """One request failed by its own fault, and only it (the run and every other request go on): `field` is
    the client's field at fault (a grammar's source), `code` says how (OpenAI's error `code`)."""

    def __init__(self, reason: str, field: str | None, code: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field, self.code = field, code


def describe_fault(error: BaseException) -> str:
    """An exception as clients may read it: its type and the first line of its reason, without paths."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    reason = re.sub(r"(?<![\w.])(?:[A-Za-z]:)?[/\\][^\s'\"]*", "<path>", (reason.strip().splitlines() or [""])[0])
    return f"{type(error).__name__}: {reason[:200]}" if reason else type(error).__name__


def build_run(build: Callable[[], T]) -> T:
    """build(); any other failure (the engine refusing its config, memory, a file) as a RunError naming it."""
    try:
        return build()
    except KvscopeError:  # already a user error with a message of its own: a 400 as it is
        raise
    except Exception as e:  # the edge: a run that cannot start is the user's to fix, never a 500
        reason = (str(e).strip().splitlines() or [""])[0]
        raise RunError(None, f"the run could not start: {type(e).__name__}: {reason}") from e
