"""Running the service with uvicorn: in the foreground (`kvscope serve`) or on a thread (tests).

The caller binds the socket (`listen`) and hands it to uvicorn, so that a busy port is an OSError
at the call site, before anything starts, and an address is printed only once it listens.

On SIGTERM or Ctrl-C every run first aborts its in-flight requests (finish_reason "abort"), so that
streams end and the server exits within seconds, paused runs included; a connection still open
after SHUTDOWN_GRACE_S is cut.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from litestar import Litestar

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SHUTDOWN_GRACE_S = 3  # then uvicorn cancels what is left: exit well within 5 s


class Server(uvicorn.Server):
    """uvicorn's server, which aborts the app's in-flight requests as soon as it is told to exit."""

    def __init__(self, app: Litestar, **config) -> None:
        super().__init__(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                                        **config))
        self.manager = app.state.manager

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler runs on the main thread between any two bytecodes, maybe inside a run's
        # lock: the aborts take those locks, so they go on a thread of their own.
        threading.Thread(target=self.manager.abort_all, name="abort-all", daemon=True).start()
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """The same, from another thread."""
        self.manager.abort_all()
        self.should_exit = True


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: any free one); OSError if it cannot."""
    # proto named: asyncio sets TCP_NODELAY on accepted connections only when it is IPPROTO_TCP.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def serve_forever(app: Litestar, sock: socket.socket) -> None:
    """Serve on a listening socket until Ctrl-C (uvicorn handles the signals)."""
    Server(app, ws_ping_interval=20).run(sockets=[sock])


@contextmanager
def serve_in_thread(app: Litestar, sock: socket.socket | None = None) -> Iterator[str]:
    """A real server (on sock, else a free loopback port) for the duration of the block; yields its URL."""
    sock = sock or listen("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    server = Server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"server on {host}:{port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://{f'[{host}]' if ':' in host else host}:{port}"
    finally:
        server.stop()
        thread.join(timeout=10)
        sock.close()


def announce_when_listening(host: str, port: int, lines: list[str], timeout_s: float = 120.0) -> None:
    """Print lines (from a daemon thread) once something accepts connections on host:port."""

    def wait_then_print() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, port), timeout=0.5).close()
            except OSError:
                time.sleep(0.1)
                continue
            print("\n".join(lines), flush=True)
            return

    threading.Thread(target=wait_then_print, name="announce", daemon=True).start()
