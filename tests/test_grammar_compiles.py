"""Clients' grammars compile off the run's worker, bounded in time and in places (#35 point 3).

A 65 KB EBNF compiled ~160 s inside admission on the stepping thread: the run stalled, every other /v1
request got a 429 after 30 s, and the compile went on after its client gave up. Now the worker never
compiles a client's grammar; past --grammar-timeout-s the request is a 400 naming the field and the limit;
past --max-grammar-compiles one more is a 429 with Retry-After; a client that leaves is not waited for, its
compile keeping its place until xgrammar returns. Compiles that must be slow are held on an Event here,
so that no test depends on how fast this machine compiles.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from kvscope.backend.engine.grammar import Grammars
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import live_server, served_model, wait_for

MODEL = served_model()
USER = [{"role": "user", "content": "Say something."}]
HELD = "held-compile"  # a grammar whose text holds this waits for the test's Event before it compiles


@pytest.fixture
def held(monkeypatch) -> Iterator[tuple[threading.Event, list[str]]]:
    """Grammars.compiled records the thread of every compile; one of a HELD grammar waits for the Event."""
    release, threads = threading.Event(), []
    compiled = Grammars.compiled

    def recording(self: Grammars, spec):
        threads.append(threading.current_thread().name)
        if HELD in str(spec.model_dump()):
            release.wait(timeout=120)
        return compiled(self, spec)

    monkeypatch.setattr(Grammars, "compiled", recording)
    yield release, threads
    release.set()


@contextmanager
def server(**limits) -> Iterator[tuple[httpx.Client, RunManager]]:
    manager = RunManager(default_model=MODEL, limits=ServiceLimits(**limits))
    with live_server(manager) as url, httpx.Client(base_url=url, timeout=120) as http:
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
        yield http, manager


def held_regex(n: int) -> dict:
    return {"messages": USER, "max_tokens": 4, "guided_regex": f"({HELD}-{n}|[a-z]+)"}


def in_background(http: httpx.Client, body: dict) -> tuple[threading.Thread, list]:
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(http.post("/v1/chat/completions", json=body)))
    thread.start()
    return thread, answers


def test_no_clients_grammar_compiles_on_the_runs_worker(held):
    """Chat, a forced tool call, the Responses API and a live request: every compile is off the run's thread."""
    _, threads = held
    tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
    with server() as (http, _):
        answers = [
            http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "guided_regex": "[0-9]{2}"}),
            http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 12, "tools": tool,
                                                     "tool_choice": "required"}),
            http.post("/v1/responses", json={"input": "Hi.", "max_output_tokens": 4,
                                              "text": {"format": {"type": "json_object"}}}),
            http.post("/api/runs/api/requests", json={"prompt": "ROMEO:", "max_tokens": 3, "sampling": {
                "structured_outputs": {"choice": ["yes", "no"]}}})]
        assert [a.status_code for a in answers] == [200, 200, 200, 201], [a.text for a in answers]
    assert len(threads) == 4 and not any(name.startswith("run-") for name in threads), threads


def test_a_grammar_past_the_time_limit_is_a_400_naming_the_field_and_the_run_serves_meanwhile(held):
    release, _ = held
    with server(grammar_timeout_s=0.5) as (http, manager):
        refused = http.post("/v1/chat/completions", json=held_regex(1))
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "guided_regex" and "--grammar-timeout-s 0.5" in error["message"]
        assert manager.usage()["grammar_compiles"] == 1  # it runs on, unobserved, holding its place
        served = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3})
        assert served.status_code == 200  # the worker steps others while it compiles
        release.set()
        wait_for(lambda: manager.usage()["grammar_compiles"] == 0, "the abandoned compile returned its place")
        again = http.post("/v1/chat/completions", json=held_regex(1))  # it landed in the run's cache
        assert again.status_code == 200, again.text


def test_one_compile_past_the_bound_is_a_429_naming_it_while_cached_grammars_are_served(held):
    release, _ = held
    with server(max_grammar_compiles=1) as (http, manager):
        assert http.post("/v1/chat/completions", json={**held_regex(0), "guided_regex": "[0-9]"}).status_code == 200
        first, answers = in_background(http, held_regex(2))
        wait_for(lambda: manager.usage()["grammar_compiles"] == 1, "the first grammar is compiling")
        busy = http.post("/v1/chat/completions", json={**held_regex(0), "guided_regex": "[a-z]{3}"})
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        assert "--max-grammar-compiles" in busy.json()["error"]["message"]
        cached = http.post("/v1/chat/completions", json={**held_regex(0), "guided_regex": "[0-9]"})
        assert cached.status_code == 200  # a grammar the cache holds takes no place
        release.set()
        first.join()
        assert answers[0].status_code == 200


def test_a_client_that_leaves_while_its_grammar_compiles_is_not_waited_for(held):
    release, _ = held
    with server() as (http, manager):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{http.base_url}/v1/chat/completions", json=held_regex(3), timeout=0.5)
        assert manager.usage()["grammar_compiles"] == 1
        assert http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3}).status_code == 200
        wait_for(lambda: not manager.get("api").engine.has_unfinished(), "the run is idle")
        release.set()
        wait_for(lambda: manager.usage()["grammar_compiles"] == 0, "the abandoned compile returned its place")
        assert manager.get("api").engine.stats.num_waiting == 0  # the gone client's request never reached the run


def test_limits_show_each_runs_grammar_cache_in_bytes_within_its_bound():
    with server(grammar_cache_mb=4) as (http, manager):
        for pattern in ("[0-9]{3}", "[a-c]+", "(yes|no)"):
            assert http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3,
                                                            "guided_regex": pattern}).status_code == 200
        limits = http.get("/api/limits").json()
        (cache,) = [c for c in limits["grammar_caches"] if c["run_id"] == "api"]
        assert 0 < cache["bytes"] <= cache["max_bytes"] == 4 * 1024**2 == limits["max_grammar_bytes_per_run"]
        assert cache["grammars"] >= 1 and limits["grammar_bytes"] == cache["bytes"]
        assert (limits["grammar_compiles"], limits["max_grammar_compiles"], limits["grammar_timeout_s"]) == (0, 2, 30)
        assert cache["bytes"] == manager.get("api").engine.grammars.cached_bytes
