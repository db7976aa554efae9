"""The websocket on a real server (127.0.0.1, a free port), read with the `websockets` client."""

import json
import socket
import time

import httpx
import pytest
from websockets.sync.client import connect

from backend.events.state import RunState
from backend.server.app import create_app
from backend.server.manager import RunManager
from backend.server.serve import serve_in_thread

STATE_KEYS = ("block_tables", "free_blocks", "ref_counts", "step", "waiting", "running")


def busy_scenario(model: str, count: int = 4, max_tokens: int = 8) -> dict:
    return {"name": "ws", "model": model, "engine": {"block_size": 4, "num_blocks": 512, "max_num_seqs": 16,
                                                     "max_model_len": 1000},
            "requests": [{"id": f"r{i}", "prompt_tokens": 5 + i, "max_tokens": max_tokens, "arrival_step": i,
                          "sampling": {"temperature": 0, "ignore_eos": True}} for i in range(count)]}


@pytest.fixture
def server():
    manager = RunManager(watcher_queue_limit=256)  # small, so that a 10 s stall surely overflows
    with serve_in_thread(create_app(manager)) as url:
        yield url, manager
    manager.stop_all()


def ws_url(url: str, run_id: str) -> str:
    return url.replace("http://", "ws://") + f"/ws/runs/{run_id}"


def follow(ws, state: RunState | None = None, until=lambda msg: False, timeout: float = 30) -> RunState:
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


def small_socket(url: str) -> socket.socket:
    """A client socket with a tiny receive buffer, so that a client that stops reading soon blocks
    the server's sends (instead of megabytes vanishing into kernel buffers)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    return sock


def steps_per_second(url: str, run_id: str, seconds: float) -> float:
    get = lambda: httpx.get(f"{url}/api/runs/{run_id}").json()["step"]  # noqa: E731
    start_step, start = get(), time.perf_counter()
    time.sleep(seconds)
    return (get() - start_step) / (time.perf_counter() - start)


def test_a_stalled_client_does_not_slow_the_engine_and_then_resyncs(server, tiny_dir):
    url, manager = server
    scenario = busy_scenario(tiny_dir, count=16, max_tokens=900)

    def start() -> str:
        rid = httpx.post(f"{url}/api/runs", json={"scenario": scenario, "speed": 0}).json()["run_id"]
        time.sleep(0.5)  # warm up
        return rid

    def stop(rid: str) -> None:
        httpx.post(f"{url}/api/runs/{rid}/control", json={"action": "pause"})

    baseline = start()
    before = steps_per_second(url, baseline, 4.0)
    stop(baseline)

    run_id = start()
    with connect(ws_url(url, run_id), max_queue=4, sock=small_socket(url)) as ws:
        ws.recv(timeout=10)  # the snapshot; then this client stops reading for 10 s
        stalled = steps_per_second(url, run_id, 10.0)
        watcher = manager.get(run_id).watchers[0]
        assert watcher.dropped > 0, "the client must have fallen behind and been resynced"
        stop(run_id)
        final = httpx.get(f"{url}/api/runs/{run_id}").json()
        state = follow(ws, None, until=lambda m: m.get("seq", -1) >= final["seq"])
    stop(baseline)

    after_run = start()
    after = steps_per_second(url, after_run, 4.0)
    stop(after_run)
    reference = (before + after) / 2
    assert stalled >= 0.95 * reference, f"{stalled:.1f} steps/s with a stalled client vs {reference:.1f}"
    assert comparable(state.snapshot()) == comparable(final)
