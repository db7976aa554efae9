"""Memory a run let go of, given back to the system.

glibc keeps what Python frees in its arenas (one per thread that allocated: a trace parsed on a request
thread lives in that thread's arena), returning pages only from the top of a heap. A replay's parsed
trace, hundreds of MB of small objects, stayed in the server's RSS after its last replay was closed.
`malloc_trim(0)` returns every arena's free pages; where libc is not glibc, nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

SOON_S = 1.0  # the last references to a forgotten run go as its callers return: well within this


def _malloc_trim():  # noqa: ANN202 - a ctypes function, or None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl without it): nothing to trim
        return None


MALLOC_TRIM = _malloc_trim()


def give_back_memory() -> None:
    """Return the pages freed so far to the system (milliseconds: glibc walks its arenas)."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


def give_back_memory_soon() -> None:
    """give_back_memory on a timer thread, once the callers that forgot a run have let go of it too: never
    under the manager's lock (glibc's walk takes milliseconds), never waited for."""
    timer = threading.Timer(SOON_S, give_back_memory)
    timer.daemon = True
    timer.start()
