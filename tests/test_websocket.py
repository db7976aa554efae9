"""The websocket on a real server (127.0.0.1, a free port), read with the `websockets` client."""

import base64
import json
import os
import socket
import struct
import time

import httpx
import pytest
from websockets.sync.client import connect

from kvscope.backend.events.state import RunState
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import live_server, scenario, wait_for

STATE_KEYS = ("block_tables", "free_blocks", "ref_counts", "step", "waiting", "running")


def busy_scenario(model: str, count: int = 4, max_tokens: int = 8) -> dict:
    return scenario(model, count, prompt_tokens=5, longer_by=1, max_tokens=max_tokens, ignore_eos=True,
                    num_blocks=512, max_num_seqs=16, max_model_len=1000)


def live_serving(tiny_dir: str, **limits):
    manager = RunManager(default_model=tiny_dir, watcher_queue_limit=256,  # small: a stall surely overflows it
                         limits=ServiceLimits(**limits))
    with live_server(manager) as url:
        yield url, manager


@pytest.fixture
def server(tiny_dir):
    yield from live_serving(tiny_dir)


@pytest.fixture
def slow_server(tiny_dir):
    """Viewers get 500 events a second: a run of the tiny model surely leaves one behind."""
    yield from live_serving(tiny_dir, viewer_events_per_s=500)


@pytest.fixture
def unbudgeted_server(tiny_dir):
    """No viewer send budget to speak of: a client that stops reading fills its socket's buffers within
    seconds, and only the queue and the resync stand between it and the engine."""
    yield from live_serving(tiny_dir, viewer_events_per_s=1e9)


def ws_url(url: str, run_id: str) -> str:
    return url.replace("http://", "ws://") + f"/ws/runs/{run_id}"


def follow(ws, state: RunState | None = None, until=lambda msg: False, timeout: float = 120) -> RunState:
    """Apply every message (a snapshot restarts the state) until `until(msg)`."""
    deadline = time.monotonic() + timeout
    while True:
        msg = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        if msg["type"] == "snapshot":
            state = RunState.from_snapshot(msg)
        elif state is not None:  # events from before a resync are stale until the next snapshot
            state.apply(msg)
        if until(msg):
            return state


def comparable(snapshot: dict) -> dict:
    return json.loads(json.dumps({k: snapshot[k] for k in STATE_KEYS}))


def test_every_client_gets_a_snapshot_then_every_event(server, tiny_dir):
    url, _ = server
    run_id = httpx.post(f"{url}/api/runs", json={"scenario": busy_scenario(tiny_dir), "paused": True,
                                                 "speed": 0}).json()["run_id"]
    with connect(ws_url(url, run_id)) as a, connect(ws_url(url, run_id)) as b:
        first = [json.loads(a.recv(timeout=10)), json.loads(b.recv(timeout=10))]
        assert [m["type"] for m in first] == ["snapshot", "snapshot"]
        httpx.post(f"{url}/api/runs/{run_id}/control", json={"action": "resume"})
        finished = lambda m: m["type"] == "run_finished"  # noqa: E731
        state_a = follow(a, RunState.from_snapshot(first[0]), finished)
        state_b = follow(b, RunState.from_snapshot(first[1]), finished)
    server_state = httpx.get(f"{url}/api/runs/{run_id}").json()
    assert comparable(state_a.snapshot()) == comparable(state_b.snapshot()) == comparable(server_state)
    assert all(r["status"] == "finished" for r in state_a.snapshot()["requests"].values())


def test_unknown_run_gets_an_error_message_and_a_close(server):
    url, _ = server
    with connect(ws_url(url, "nope")) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "error"


class RawWebSocket:
    """A websocket client that can truly stop reading: a plain socket with a tiny receive buffer.

    (The `websockets` client keeps draining the socket into its own buffers in a background thread,
    so it never really stalls a server.) Server frames are unmasked and, without extensions,
    uncompressed: a few lines read them.
    """

    def __init__(self, url: str, path: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self.sock.recv(4096)
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        assert b" 101 " in head.split(b"\r\n")[0]

    def _read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            assert chunk, "the server closed the connection"
            self.buffer += chunk
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def recv(self, timeout: float = 120) -> str:
        self.sock.settimeout(timeout)
        b0, b1 = self._read(2)
        length = b1 & 0x7F
        if length == 126:
            length = struct.unpack(">H", self._read(2))[0]
        elif length == 127:
            length = struct.unpack(">Q", self._read(8))[0]
        payload = self._read(length)
        opcode = b0 & 0x0F
        if opcode == 9:  # ping: answer, as any client must, or the server closes the connection
            mask = os.urandom(4)
            self.sock.sendall(bytes([0x8A, 0x80 | length]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        return payload.decode() if opcode == 1 else self.recv(timeout)

    def close(self) -> None:
        self.sock.close()


def wait_for_step(url: str, run_id: str, step: int, timeout: float = 300) -> None:
    wait_for(lambda: httpx.get(f"{url}/api/runs/{run_id}").json()["step"] >= step, f"the run reached step {step}",
             timeout)


def test_a_stalled_client_does_not_hold_the_engine_back(unbudgeted_server):
    url, manager = unbudgeted_server
    # A client that stops reading after its snapshot: once the socket's buffers and its bounded queue
    # are full, the engine must drop that client's events (it resyncs later) and step on, never wait.
    # How fast it steps with such clients is bench/viewers.py's to measure (--slow-ms).
    scenario = busy_scenario("demo", count=32, max_tokens=900)
    run_id = httpx.post(f"{url}/api/runs", json={"scenario": scenario, "speed": 0}).json()["run_id"]
    ws = RawWebSocket(url, f"/ws/runs/{run_id}")
    try:
        ws.recv(timeout=60)  # the snapshot; then this client reads nothing more
        watcher = manager.get(run_id).viewers.watchers[0]
        wait_for(lambda: watcher.dropped, "the stalled client's queue overflowed", 300)
        full_at = httpx.get(f"{url}/api/runs/{run_id}").json()["step"]
        wait_for_step(url, run_id, full_at + 50)  # the client still reads nothing: the engine went on
        assert watcher.needs_snapshot and len(watcher.queue) == 0, "it fell behind and waits for a fresh snapshot"
        assert watcher.dropped > 0
    finally:
        ws.close()
    assert not manager.get(run_id).finished, "the run must outlast the measurement"
    httpx.post(f"{url}/api/runs/{run_id}/control", json={"action": "pause"})


def test_a_client_that_falls_behind_resyncs_to_the_engines_state(slow_server, tiny_dir):
    url, manager = slow_server
    run_id = httpx.post(f"{url}/api/runs", json={"scenario": busy_scenario(tiny_dir, count=8, max_tokens=300),
                                                 "speed": 0}).json()["run_id"]
    with connect(ws_url(url, run_id), max_queue=4) as ws:
        ws.recv(timeout=10)
        watcher = manager.get(run_id).viewers.watchers[0]  # this client, which reads nothing for now
        wait_for(lambda: watcher.dropped, "the server dropped events for this client (its queue holds 256)")
        seen: list[str] = []
        # The end: run_finished, or a resync snapshot taken after it.
        state = follow(ws, None, until=lambda m: seen.append(m["type"]) or m["type"] == "run_finished"
                       or m["type"] == "snapshot" and m["finished"])
    assert "snapshot" in seen, "falling behind must have brought a fresh snapshot"
    final = httpx.get(f"{url}/api/runs/{run_id}").json()
    assert comparable(state.snapshot()) == comparable(final)
    assert all(r["status"] == "finished" for r in final["requests"].values())
