"""A served tensor-parallel run lets go of its ranks as soon as it no longer needs them (issue #35, point 5).

Finished, failed or forgotten: its rank processes, the store's and gloo's ports and threads, are gone
within seconds, where they used to stay until the run's worker thread ended (when the server forgot
the run, if ever). A finished tensor-parallel run then refuses a live request with a 409 naming its
state. Ranks are real processes here; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from litestar.testing import TestClient

from kvscope.backend.server.app import create_app
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from tests.test_tp_robustness import listening_ports, rank_pids

RELEASE_S = 10.0  # "within seconds": a rank told to stop exits, or is killed after tp_runner.JOIN_S
WAIT_S = 60.0


def eventually(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def scenario(max_tokens: int = 3, **engine) -> dict:
    return {"name": "tp", "model": "demo", "seed": 0,
            "engine": {"tensor_parallel": 2, "num_blocks": 64, "events": "summary", **engine},
            "requests": [{"id": "r", "prompt": "ROMEO:\n", "max_tokens": max_tokens,
                          "sampling": {"temperature": 0, "ignore_eos": True}}]}


def group_threads() -> list[str]:
    """This process's threads that a process group or a store runs (gloo's loops, the TCPStore's libuv loop),
    by their native names."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # ended since the listing
            continue
    return [n for n in names if "gloo" in n or "tcpstore" in n]


def run_workers() -> list[str]:
    """The served runs' worker threads (run_worker.py names each after its run)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("run-") and t.name != "run-watchdog"]


def shared_memory() -> set[str]:
    """/dev/shm's entries, but Chromium's own (.org.chromium.*): a browser test may run beside this one (CI
    runs the lesson walk in a pytest of its own, alongside)."""
    names = os.listdir("/dev/shm") if Path("/dev/shm").is_dir() else []
    return {n for n in names if not n.startswith(".org.chromium.")}


@pytest.fixture
def served():
    manager = RunManager(default_model="demo", limits=ServiceLimits(max_runs=16, stall_timeout_s=3))
    with TestClient(create_app(manager), base_url="http://127.0.0.1:8000") as client:
        yield client
    manager.stop_all()


def finish(served: TestClient, **engine) -> str:
    """A tensor-parallel run, unpaced, until it finished; its id."""
    run_id = served.post("/api/runs", json={"scenario": scenario(**engine), "speed": 0}).json()["run_id"]
    eventually(lambda: served.get(f"/api/runs/{run_id}").json()["finished"], "the run finished")
    return run_id


def test_eight_finished_tensor_parallel_runs_leave_no_rank_port_thread_or_shared_memory_behind(served):
    ports, shm = listening_ports(), shared_memory()
    assert not group_threads()
    runs = []
    for _ in range(8):
        runs.append(finish(served))
        eventually(lambda: not rank_pids(os.getpid()), "its rank stopped as it finished", RELEASE_S)
    assert not any(served.get(f"/api/runs/{r}").json()["failed"] for r in runs)
    eventually(lambda: listening_ports() <= ports, "the stores' and gloo's ports closed", RELEASE_S)
    assert shared_memory() <= shm
    # What the runs still hold while the server keeps them: each its own worker thread (any run has one), and
    # nothing of its ranks (gloo's and the store's threads).
    eventually(lambda: not group_threads(), "the groups' threads ended", RELEASE_S)
    assert sorted(run_workers()) == sorted(f"run-{r}" for r in runs)
    for run_id in runs:
        assert served.delete(f"/api/runs/{run_id}").status_code == 204
    eventually(lambda: not run_workers(), "the forgotten runs' worker threads ended", RELEASE_S)
    assert served.get("/api/limits").json()["runs"] == 0


def test_a_live_request_to_a_finished_tensor_parallel_run_is_a_409_naming_its_state(served):
    run_id = finish(served)
    answer = served.post(f"/api/runs/{run_id}/requests", json={"prompt": "KING:", "max_tokens": 3})
    assert answer.status_code == 409, answer.text
    assert answer.json()["state"] == "finished"
    assert "its tensor-parallel ranks were stopped" in answer.json()["error"]
    assert "start a new run" in answer.json()["error"]
    assert served.post(f"/api/runs/{run_id}/control", json={"action": "step"}).status_code == 200  # nothing to run
    plain = finish(served, tensor_parallel=1)
    woken = served.post(f"/api/runs/{plain}/requests", json={"prompt": "KING:", "max_tokens": 3})
    assert woken.status_code == 201, "a run on one process keeps its engine: finished, it wakes for a request"


def test_a_run_failed_while_its_step_hangs_on_a_rank_lets_its_ranks_go_at_once(served):
    """A stopped rank (SIGSTOP) holds the step in a collective for the group's whole timeout (here 600 s); the
    server fails the run after --stall-timeout-s (3 s), and its ranks go then, not when the collective gives up."""
    before = listening_ports()
    run_id = served.post("/api/runs", json={"scenario": scenario(max_tokens=2000, tensor_parallel_timeout_s=600),
                                            "paused": True}).json()["run_id"]
    ports = listening_ports() - before
    [rank] = rank_pids(os.getpid())
    worker = next(t for t in threading.enumerate() if t.name == f"run-{run_id}")
    os.kill(rank, signal.SIGSTOP)
    served.post(f"/api/runs/{run_id}/control", json={"action": "resume"})
    eventually(lambda: served.get(f"/api/runs/{run_id}").json()["failed"], "the watchdog failed the run")
    eventually(lambda: not rank_pids(os.getpid()), "the stopped rank was killed", RELEASE_S)
    eventually(lambda: not listening_ports() & ports, "the group's ports closed", RELEASE_S)
    worker.join(RELEASE_S)
    assert not worker.is_alive(), "the step stuck on the rank failed, and the worker ended"


def test_a_forgotten_tensor_parallel_run_lets_its_ranks_go_at_once(served):
    run_id = served.post("/api/runs", json={"scenario": scenario(), "paused": True}).json()["run_id"]
    eventually(lambda: rank_pids(os.getpid()), "the run's rank started")
    assert served.delete(f"/api/runs/{run_id}").status_code == 204
    eventually(lambda: not rank_pids(os.getpid()), "its rank stopped", RELEASE_S)
    assert served.get(f"/api/runs/{run_id}").status_code == 404
    assert served.delete(f"/api/runs/{run_id}").status_code == 404
