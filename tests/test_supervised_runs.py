"""Supervised runs and faults that lose nothing: a fault on a run's worker, a stalled step, a full or
vanished trace disk, a restart over an earlier trace, controls after a huge step.

Faults are injected (the engine's step raising once, a step that blocks, a writer out of space), not
only the known triggers. Servers bind 127.0.0.1 only; every wait is bounded in count and time.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading

import pytest
from litestar.testing import TestClient

from kvscope.backend.engine.engine import Engine
from kvscope.backend.events.schema import parse_event
from kvscope.backend.events.state import RunState
from kvscope.backend.server.manager import API_RUN_ID, RunManager
from kvscope.backend.server.replay import ReplayRun
from kvscope.backend.server.run_errors import describe_fault
from kvscope.frontend.app import run_state
from kvscope.frontend.client import RunFeed
from tests.server_helpers import in_process, scenario, serving, settled_snapshot, wait_for

INJECTED = "injected fault reading /srv/secret/weights.bin"


def short_requests(model: str, requests: int = 1) -> dict:
    """scenario() of `requests` requests of 6 prompt tokens and 4 to generate, one arriving a step, in 64 blocks."""
    return scenario(model, requests, longer_by=0, max_tokens=4, num_blocks=64)


@pytest.fixture
def run_log():
    """The run worker's log records (the app's logging setup at startup replaces the root's handlers)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("kvscope.backend.server.run_worker")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def fault_once(monkeypatch, cls=Engine, method: str = "step", skip: int = 0) -> list[int]:
    """cls.method raises RuntimeError(INJECTED) on its call number skip + 1, and works otherwise."""
    original, calls = getattr(cls, method), []

    def faulty(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == skip + 1:
            raise RuntimeError(INJECTED)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, faulty)
    return calls


def events_of(client: TestClient, run_id: str) -> list[dict]:
    return [json.loads(line) for line in client.get(f"/api/runs/{run_id}/trace").text.splitlines()]


def finished_trace(client: TestClient, tiny_dir: str) -> list[dict]:
    run_id = client.post("/api/runs", json={"scenario": short_requests(tiny_dir, 3), "speed": 0}).json()["run_id"]
    wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
    return events_of(client, run_id)


def jsonl(events: list[dict]) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


# ---- 1. a fault on a run's worker ------------------------------------------------------------------


def test_a_fault_in_a_scenario_step_fails_the_run_with_one_error_event_and_its_place_goes_to_the_next_run(
        tiny_dir, monkeypatch, run_log):
    fault_once(monkeypatch)
    with serving(tiny_dir, max_runs=2) as (client, manager):
        run_id = client.post("/api/runs", json={"scenario": short_requests(tiny_dir), "speed": 0}).json()["run_id"]
        wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["failed"])
        snap = client.get(f"/api/runs/{run_id}").json()
        assert (snap["finished"], snap["finish_reason"], snap["step"]) == (True, "failed", -1)
        error = events_of(client, run_id)[-1]
        assert parse_event(error).type == "error"
        assert (error["message"], error["fatal"]) == \
            ("the run failed (RuntimeError: injected fault reading <path>)", True)  # no path, no traceback
        assert [r["failed"] for r in client.get("/api/runs").json()] == [True]
        [record] = [r for r in run_log if r.getMessage().startswith(f"run {run_id} failed")]
        assert record.exc_info[1].args == (INJECTED,)  # the server's log has the whole exception
        refused = client.post(f"/api/runs/{run_id}/control", json={"action": "resume"})
        assert refused.status_code == 400 and refused.json()["error"].startswith(f"run {run_id!r} failed: ")
        assert client.post(f"/api/runs/{run_id}/requests", json={"prompt": "ab"}).status_code == 400

        # Two places: the failed run counts as finished, so the second new run takes its place.
        for _ in range(2):
            started = client.post("/api/runs", json={"scenario": short_requests(tiny_dir), "speed": 0, "paused": True})
            assert started.status_code == 201
        assert client.get(f"/api/runs/{run_id}").status_code == 404
        assert manager.kv_bytes.keys() == {r["run_id"] for r in client.get("/api/runs").json()}


def test_a_fault_in_the_api_run_answers_its_waiting_request_at_once_and_the_next_request_is_served(
        tiny_dir, monkeypatch):
    fault_once(monkeypatch)
    with serving(tiny_dir) as (client, manager):
        failed = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3})
        assert failed.status_code == 409 and failed.headers["retry-after"] == "1"
        error = failed.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "run_failed")
        assert "RuntimeError: injected fault reading <path>" in error["message"] and "/srv" not in failed.text
        dead = manager.get(API_RUN_ID)
        dead.worker.thread.join(timeout=60)  # the answer came first; the worker ends right after it
        assert dead.failure is not None and not dead.worker.thread.is_alive()

        served = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3})
        assert served.status_code == 200 and served.json()["choices"][0]["finish_reason"] == "length"
        fresh = manager.get(API_RUN_ID)
        assert fresh is not dead and fresh.failure is None
        assert list(manager.kv_bytes) == [API_RUN_ID]  # the dead run's KV cache is no longer counted


def test_a_stream_cut_by_a_run_fault_ends_with_an_openai_error_chunk_then_done(tiny_dir, monkeypatch):
    fault_once(monkeypatch, skip=1)  # the prompt's step runs, the next one fails
    with serving(tiny_dir) as (client, manager):
        body = {"prompt": "ab", "max_tokens": 8, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert (error["type"], error["code"]) == ("server_error", "run_failed")
        assert all("choices" in json.loads(chunk) for chunk in data[:-2])


def test_a_fault_in_a_replay_step_fails_the_replay(tiny_dir, monkeypatch):
    with serving(tiny_dir) as (client, manager):
        trace = jsonl(finished_trace(client, tiny_dir))
        fault_once(monkeypatch, ReplayRun, "_advance", skip=2)  # the header, iteration 0, then the fault
        run_id = client.post("/api/runs", json={"trace": trace, "speed": 0}).json()["run_id"]
        wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["failed"])
        snap = client.get(f"/api/runs/{run_id}").json()
        assert (snap["step"], snap["error"]) == (0, "the run failed (RuntimeError: injected fault reading <path>)")
        assert client.post(f"/api/runs/{run_id}/control", json={"action": "seek", "value": 0}).status_code == 400


def test_replays_whose_lesson_step_is_malformed_never_hold_the_servers_places(tiny_dir):
    """The known trigger: a second header whose lesson has a step that is not an object. Whether the upload
    is refused (400) or its run fails, none of 17 such uploads stays alive holding one of the 16 places."""
    with serving(tiny_dir, max_runs=16) as (client, manager):
        events = finished_trace(client, tiny_dir)
        second = {**events[0], "step": 1, "scenario": {**events[0]["scenario"], "lesson": ["not a step"]}}
        trace = jsonl([e for e in events if e["step"] <= 1] + [second] + [e for e in events if e["step"] > 1])
        for _ in range(17):
            answer = client.post("/api/runs", json={"trace": trace, "speed": 0})
            assert answer.status_code in (201, 400), answer.text
            if answer.status_code == 201:
                run_id = answer.json()["run_id"]
                wait_for(lambda: manager.get(run_id) is None or manager.get(run_id).failure is not None)
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        started = client.post("/api/runs", json={"scenario": short_requests(tiny_dir), "speed": 0})
        assert started.status_code == 201


# ---- 2. the watchdog --------------------------------------------------------------------------------


def test_a_stalled_step_fails_the_api_run_and_answers_its_waiting_request(tiny_dir, monkeypatch, run_log):
    release, entered = threading.Event(), threading.Event()
    original = Engine.step

    def stalled(self):
        entered.set()
        release.wait(timeout=120)
        return original(self)

    monkeypatch.setattr(Engine, "step", stalled)
    with serving(tiny_dir, stall_timeout_s=0.5) as (client, manager):
        answer = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert entered.is_set() and answer.status_code == 409
        assert "no progress for 0.5 s (--stall-timeout-s)" in answer.json()["error"]["message"]
        dead = manager.get(API_RUN_ID)
        error = dead.state.snapshot()
        assert (error["failed"], error["error"]) == (True, "the run failed (no progress for 0.5 s (--stall-timeout-s))")
        [record] = [r for r in run_log if r.getMessage().startswith(f"run {API_RUN_ID} failed")]
        assert "in stalled" in record.getMessage()  # the worker's stack, where it is stuck
        seq = dead.state.last_seq
        release.set()  # the stuck step returns: what it emits after the run failed is dropped
        dead.worker.thread.join(timeout=60)
        assert not dead.worker.thread.is_alive() and dead.state.last_seq == seq


def test_a_paced_or_paused_run_is_never_taken_for_a_stalled_one(tiny_dir):
    with serving(tiny_dir, stall_timeout_s=0.5) as (client, manager):
        paced = client.post("/api/runs", json={"scenario": short_requests(tiny_dir), "speed": 1}).json()["run_id"]
        paused = client.post("/api/runs", json={"scenario": short_requests(tiny_dir), "paused": True}).json()["run_id"]
        wait_for(lambda: client.get(f"/api/runs/{paced}").json()["step"] >= 2)  # 1 s a step, 0.5 s allowed
        assert [r["failed"] for r in client.get("/api/runs").json()] == [False, False]
        client.post(f"/api/runs/{paused}/control", json={"action": "step"})
        wait_for(lambda: client.get(f"/api/runs/{paused}").json()["step"] == 0)
        assert not client.get(f"/api/runs/{paused}").json()["failed"]


# ---- 3. trace files: full or vanished disks, restarts --------------------------------------------


class FullDisk:
    """A trace file with room for `lines` lines; then every write is ENOSPC, as on a full disk."""

    def __init__(self, path, lines: int) -> None:
        self.file, self.room = path.open("x", encoding="utf-8"), lines

    def write(self, text: str) -> int:
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.file.name))
        self.room -= 1
        return self.file.write(text)

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def test_a_full_disk_stops_the_trace_file_not_the_run(tiny_dir, tmp_path, monkeypatch):
    def full_disk(folder, run_id):
        path = folder / f"{run_id}.jsonl"
        return path, FullDisk(path, lines=3)

    monkeypatch.setattr("kvscope.backend.server.trace_file._create", full_disk)
    with serving(tiny_dir, trace_dir=str(tmp_path)) as (client, manager):
        run_id = client.post("/api/runs", json={"scenario": short_requests(tiny_dir, 2), "speed": 0}).json()["run_id"]
        wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
        snap = client.get(f"/api/runs/{run_id}").json()
        assert not snap["failed"] and all(r["status"] == "finished" for r in snap["requests"].values())
        assert snap["error"] == "the trace file stopped (No space left on device); the run goes on without it"
        trace = client.get(f"/api/runs/{run_id}/trace")
        assert trace.status_code == 503 and "No space left on device" in trace.json()["error"]
        assert str(tmp_path) not in trace.text
        kept = [json.loads(line) for line in manager.get(run_id).trace_jsonl().splitlines()]
        errors = [e for e in kept if e["type"] == "error"]
        assert [e["fatal"] for e in errors] == [False] and errors[0]["seq"] == 4  # right after the 4th line


def test_a_trace_folder_removed_mid_run_stops_the_file_and_the_api_run_goes_on(tiny_dir, tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    with serving(tiny_dir, trace_dir=str(folder)) as (client, manager):
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        assert client.get(f"/api/runs/{API_RUN_ID}/trace").status_code == 200
        shutil.rmtree(folder)
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        trace = client.get(f"/api/runs/{API_RUN_ID}/trace")
        assert trace.status_code == 503 and "the trace folder was removed" in trace.json()["error"]
        assert str(tmp_path) not in trace.text
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        snap = client.get(f"/api/runs/{API_RUN_ID}").json()
        assert not snap["failed"]
        assert snap["error"] == "the trace file stopped (the trace folder was removed); the run goes on without it"


def settled_trace(client) -> str:
    """The API run's trace once its step is over: the answer comes at request_finished, and the step's
    metrics event may still be on its way to the file; the worker answers a call only after the step."""
    settled_snapshot(client, API_RUN_ID)
    return client.get(f"/api/runs/{API_RUN_ID}/trace").text


def test_a_restart_never_overwrites_an_earlier_trace(tiny_dir, tmp_path):
    written = []
    for _ in range(2):  # the same --trace-dir, two servers one after the other
        with serving(tiny_dir, trace_dir=str(tmp_path)) as (client, manager):
            assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
            written.append(settled_trace(client))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api-1.jsonl", "api.jsonl"]
    assert [(tmp_path / name).read_text() for name in ("api.jsonl", "api-1.jsonl")] == written
    assert [text.count('"type":"request_finished"') for text in written] == [1, 1]


# ---- 4. controls after a huge step ----------------------------------------------------------------


def test_pause_and_seek_are_honoured_after_a_step_of_a_million(tiny_dir):
    manager = RunManager(default_model=tiny_dir)
    with in_process(manager) as client:
        events = finished_trace(client, tiny_dir)
    run = ReplayRun(events, speed=0, paused=True)
    gate, entered, advance = threading.Semaphore(0), [], run._advance

    def gated() -> None:  # each iteration waits for the test to let it through
        entered.append(1)
        assert gate.acquire(timeout=60)
        advance()

    run._advance = gated
    run.start()
    try:
        run.control("step", 1_000_000)
        wait_for(lambda: len(entered) == 1)
        run.control("pause")
        gate.release()
        for _ in range(2):  # two trips through the worker's loop: a step still owed would have run
            run.call(lambda: None)
        assert (len(entered), run.state.step) == (1, 0)

        run.control("step", 1_000_000)
        wait_for(lambda: len(entered) == 2)
        seek = threading.Thread(target=run.control, args=("seek", 3))
        seek.start()
        wait_for(lambda: run.pacing.steps_requested == 0)
        gate.release()
        seek.join(timeout=60)
        for _ in range(2):
            run.call(lambda: None)
        assert (len(entered), run.state.step, run.pacing.paused) == (2, 2, True)  # just before iteration 3
    finally:
        gate.release(100)
        run.stop()


# ---- 5. the pieces: the reducer, fault messages, the dashboard ------------------------------------


def test_the_reducer_and_the_dashboard_show_a_fatal_error_as_a_failed_run():
    state = RunState()
    state.apply({"type": "error", "seq": 0, "step": 3, "t": 0.0, "message": "the trace file stopped (x)",
                 "fatal": False})
    assert (state.failed, state.finished, state.error) == (False, False, "the trace file stopped (x)")
    state.apply({"type": "error", "seq": 1, "step": 3, "t": 0.0, "message": "the run failed (E: y)", "fatal": True})
    assert (state.failed, state.finished, state.finish_reason) == (True, True, "failed")
    again = RunState.from_snapshot(json.loads(json.dumps(state.snapshot())))
    assert (again.failed, again.error) == (True, "the run failed (E: y)")
    assert run_state({"failed": True, "finished": True, "paused": False}) == "failed"

    feed = RunFeed(None, "r")
    feed.handle({"type": "snapshot", **state.snapshot()})
    feed.handle({"type": "error", "seq": 2, "step": 3, "t": 0.0, "message": "the run failed (E: y)", "fatal": True})
    assert not feed.missing and feed.state.failed  # a run's error event is not the socket's "no such run"
    feed.handle({"type": "error", "error": "no run 'x'"})
    assert feed.missing


@pytest.mark.parametrize(("error", "described"), [
    (ZeroDivisionError("division by zero"), "ZeroDivisionError: division by zero"),
    (OSError(errno.ENOSPC, "No space left on device", "/srv/traces/api.jsonl"), "OSError: No space left on device"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), "FileNotFoundError: No such file or directory"),
    (KeyError("logical_index"), "KeyError: 'logical_index'"),
    (ValueError("cannot read '/home/me/x.gguf' at offset 3\nmore"), "ValueError: cannot read '<path>' at offset 3"),
    (RuntimeError(), "RuntimeError"),
])
def test_a_fault_is_described_by_its_type_and_first_line_without_paths(error, described):
    assert describe_fault(error) == described
