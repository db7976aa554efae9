"""What the tests of the server, the dashboard and the browser share: waits, servers, clients, scenarios.

Waits poll a condition until a deadline and then fail saying what did not happen (the words given, or
the condition's own source): a test never sleeps a fixed time and then checks, which a loaded machine
breaks one way (too slow: the thing had not happened yet) or the other (a bound on what happened in
the sleep). tests/test_no_timed_assertions.py fails on a sleep followed by an assertion.

"Nothing more happened" is a state too. `settled_snapshot` and `settled_feed` (a dashboard's feed) make
two round trips through the run's worker thread, which runs what it is handed between two iterations:
an iteration the worker would take on its own (a paused run that steps anyway) runs before it can
answer the second. The step read after them is where the run stays, not where it was when a sleep
ended. In process the round trip is a call the worker runs (`ServedRun.call`); over HTTP it is a
control that changes nothing (the speed it has), which an engine run's worker records as an event
before any iteration the control lets run, and the POST returns once it has.

Servers: `app_client(manager)` is Litestar's in-process client, `in_process(manager)` the same entered
(the manager's runs stopped after), `serving(model, **limits)` the same with its manager under those
limits, and `live_server(manager)` a real server on a free loopback port. The module-scoped fixtures
`model_name`, `manager`, `url` and `client` (an OpenAI client) give each API test module its own live
server on the demo model: import them by name (`from tests.server_helpers import client, manager,
model_name, url  # noqa: F401`).
"""

from __future__ import annotations

import asyncio
import linecache
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx
import openai
import pytest
from litestar.testing import TestClient

from kvscope.backend.model.loader import SHIPPED_MODELS_DIR
from kvscope.backend.server.app import create_app
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.serve import serve_in_thread

T = TypeVar("T")
WAIT_S = 120.0  # generous: a loaded CI machine took over 20 s for a first paint; a pass never waits this long
POLL_S = 0.02
LOCAL = "http://127.0.0.1:8000"  # the in-process client's base: on a loopback bind the Host must be a loopback name
JSON = {"content-type": "application/json"}

# ---- waiting on a condition ----------------------------------------------------------------------------


def wait_for(condition: Callable[[], T], what: str | None = None, timeout: float = WAIT_S) -> T:
    """condition()'s first truthy value, polled until `timeout` s; else AssertionError saying what did not
    happen: `what` (words for what should have come true, or for the failure), or the condition's source."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what or described(condition)}")
        time.sleep(POLL_S)
    return value


async def until(condition: Callable[[], T], what: str | None = None, timeout: float = WAIT_S) -> T:
    """wait_for on an event loop: the loop runs (the dashboard's timers, its websocket) between the polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := condition()):
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what or described(condition)}")
        await asyncio.sleep(POLL_S)
    return value


def described(condition: Callable[[], Any]) -> str:
    """A condition in words: a lambda's body as written (`feed.state.step == 0`), else the function's name."""
    name = getattr(condition, "__qualname__", repr(condition))
    code = getattr(condition, "__code__", None)
    lines = linecache.getlines(code.co_filename) if code is not None and name.endswith("<lambda>") else []
    # where the body's instructions come from: (line, end line, column, end column), columns in UTF-8 bytes
    spans = [p for p in (code.co_positions() if lines else ()) if None not in p and p[2:] != (0, 0)]
    if not spans:
        return name
    (first, start), (last, end) = min((p[0], p[2]) for p in spans), max((p[1], p[3]) for p in spans)
    body = [line.encode() for line in lines[first - 1:last]]
    body[-1] = body[-1][:end]  # first, on one line: the start below counts from the same line's beginning
    body[0] = body[0][start:]
    return " ".join(b"".join(body).decode().replace("\\\n", " ").split())


# ---- runs settled by round trips through their worker --------------------------------------------------


def settled_snapshot(http: str | httpx.Client | TestClient, run_id: str) -> dict:
    """The run's snapshot once its worker has answered two round trips (the module's docstring says why
    that proves no iteration is under way or due). `http`: an in-process client, or a base URL or an
    httpx client of a live server (an engine run's controls, then: a replay's do not wait for its worker)."""
    if isinstance(http, TestClient):
        run = http.app.state.manager.get(run_id)
        for _ in range(2):
            run.call(lambda: None)
        return http.get(f"/api/runs/{run_id}").json()
    if isinstance(http, str):
        with httpx.Client(base_url=http, timeout=60) as client:
            return settled_snapshot(client, run_id)
    before = http.get(f"/api/runs/{run_id}").json()
    assert before["kind"] != "replay", "over HTTP only an engine run's controls wait for its worker"
    for _ in range(2):
        answer = http.post(f"/api/runs/{run_id}/control", json={"action": "speed", "value": before["speed"]})
        assert answer.status_code == 200, answer.text
    return http.get(f"/api/runs/{run_id}").json()


async def settled_feed(backend: Any, feed: Any) -> None:
    """settled_snapshot over HTTP for a dashboard's feed of an engine run (frontend.client's Backend and
    RunFeed), then wait until the feed has applied every event up to the settled snapshot's."""
    path = f"/api/runs/{feed.run_id}"
    before = await backend.request("GET", path)
    assert before["kind"] != "replay", "over HTTP only an engine run's controls wait for its worker"
    for _ in range(2):
        await backend.control(feed.run_id, "speed", before["speed"])
    seq = (await backend.request("GET", path))["seq"]
    await until(lambda: feed.state is not None and feed.state.last_seq >= seq,
                f"the feed of run {feed.run_id} reached event {seq}")


# ---- servers and clients -------------------------------------------------------------------------------


def app_client(manager: RunManager) -> TestClient:
    """The app on `manager` through Litestar's in-process client (enter it: `with app_client(m) as c`)."""
    return TestClient(create_app(manager), base_url=LOCAL)


@contextmanager
def in_process(manager: RunManager) -> Iterator[TestClient]:
    """app_client(manager), entered; the manager's runs stopped after."""
    try:
        with app_client(manager) as client:
            yield client
    finally:
        manager.stop_all()


@contextmanager
def serving(model: str | None = None, **limits: Any) -> Iterator[tuple[TestClient, RunManager]]:
    """in_process on a manager serving `model` under ServiceLimits(**limits): the client and the manager."""
    manager = RunManager(default_model=model, limits=ServiceLimits(**limits))
    with in_process(manager) as client:
        yield client, manager


@contextmanager
def live_server(manager: RunManager) -> Iterator[str]:
    """A real server for `manager` on a free loopback port, for the block; yields its URL. The manager's
    runs are stopped after."""
    try:
        with serve_in_thread(create_app(manager)) as url:
            yield url
    finally:
        manager.stop_all()


def served_model() -> str:
    # The shipped demo model is retrained from time to time; an earlier copy stands in meanwhile.
    return "demo" if (SHIPPED_MODELS_DIR / "demo" / "model.safetensors").is_file() else "/tmp/demo800"


@pytest.fixture(scope="module")
def model_name() -> str:
    return served_model()


@pytest.fixture(scope="module")
def manager(model_name: str) -> Iterator[RunManager]:
    manager = RunManager(default_model=model_name)
    yield manager
    manager.stop_all()


@pytest.fixture(scope="module")
def url(manager: RunManager) -> Iterator[str]:
    with serve_in_thread(create_app(manager)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


# ---- scenarios -------------------------------------------------------------------------------------------


def scenario(model: str, requests: int = 4, *, prompt_tokens: int = 6, longer_by: int = 3, max_tokens: int = 6,
             ignore_eos: bool = False, **engine: Any) -> dict:
    """A scenario named "t" on `model`: `requests` greedy requests, r<i> arriving at step i with a prompt of
    prompt_tokens + longer_by * i tokens; 4-token blocks, 128 of them (`engine` fields add or override)."""
    sampling = {"temperature": 0, **({"ignore_eos": True} if ignore_eos else {})}
    return {"name": "t", "model": model, "seed": 1, "engine": {"block_size": 4, "num_blocks": 128, **engine},
            "requests": [{"id": f"r{i}", "prompt_tokens": prompt_tokens + longer_by * i, "max_tokens": max_tokens,
                          "arrival_step": i, "sampling": sampling} for i in range(requests)]}


def one_request(model: str, **engine: Any) -> dict:
    """scenario() of one short request: r0, 6 prompt tokens and 2 to generate, in 64 blocks."""
    return scenario(model, 1, max_tokens=2, **{"num_blocks": 64, **engine})
