"""A server left running: bounded memory, resource limits, no server paths, backpressure, cancellation.

Servers bind 127.0.0.1 only; every loop is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from litestar.exceptions import WebSocketDisconnect

from kvscope.backend.events.state import RunState
from kvscope.backend.server.limits import MB, ServiceLimits
from kvscope.backend.server.manager import API_RUN_ID, RunManager
from kvscope.backend.server.run_errors import RunBusy
from kvscope.backend.server.serve import free_port
from tests.server_helpers import live_server, one_request, serving, wait_for

ROOT = Path(__file__).resolve().parents[1]


# ---- 1. bounded memory ----------------------------------------------------------------------------


def test_the_reducer_keeps_a_window_of_finished_requests():
    state = RunState(max_finished=2)
    state.apply({"type": "header", "seq": 0, "step": -1, "schema_version": 1, "run_id": "r", "scenario": None,
                 "config": {}, "model": {}, "cache": {"num_blocks": 4}})
    for i in range(5):
        rid = f"r{i}"
        state.apply({"type": "request_arrived", "seq": 1 + 3 * i, "step": i, "request_id": rid, "seq_id": i,
                     "prompt_token_ids": [1], "prompt_text": "x", "sampling": {}, "max_tokens": 1})
        state.apply({"type": "token", "seq": 2 + 3 * i, "step": i, "request_id": rid, "seq_id": i, "position": 1,
                     "token_id": 5, "text": "y", "logprob": 0.0})
        state.apply({"type": "request_finished", "seq": 3 + 3 * i, "step": i, "request_id": rid, "seq_id": i,
                     "finish_reason": "length", "output_token_ids": [5], "output_text": "y", "ttft_s": 0.0,
                     "tpot_s": None, "e2e_s": 0.0})
    assert list(state.requests) == ["r3", "r4"]
    assert set(state.last_token_by_request) == {"r3", "r4"} and set(state.seq_request) == {3, 4}


def test_the_api_run_keeps_a_bounded_window_and_streams_the_whole_trace_to_a_file(tiny_dir, tmp_path):
    with serving(tiny_dir, history=3, trace_window=20, trace_dir=str(tmp_path)) as (client, manager):
        for _ in range(8):
            assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}).status_code == 200
        snap = client.get(f"/api/runs/{API_RUN_ID}").json()
        assert len(snap["requests"]) == 3
        window = manager.get(API_RUN_ID).trace_jsonl().splitlines()
        assert len(window) == 21 and json.loads(window[0])["type"] == "header"
        whole = client.get(f"/api/runs/{API_RUN_ID}/trace").text.splitlines()
        assert sum(json.loads(line)["type"] == "request_finished" for line in whole) == 8
        assert manager.get(API_RUN_ID).engine.requests == {}  # the engine forgets what it finished


def test_a_scenario_run_keeps_its_own_requests_and_a_window_of_live_ones(tiny_dir):
    with serving(tiny_dir, history=2) as (client, manager):
        run_id = client.post("/api/runs", json={"scenario": one_request(tiny_dir), "speed": 0}).json()["run_id"]
        for _ in range(4):
            live = client.post(f"/api/runs/{run_id}/requests", json={"prompt": "ab", "max_tokens": 1})
            assert live.status_code == 201
        run = manager.get(run_id)
        wait_for(lambda: sum(r.status == "finished" for r in run.state.requests.values()) == 3 and not run.state.waiting
                 and not run.state.running)
        assert len(client.get(f"/api/runs/{run_id}").json()["requests"]) == 3  # 1 planned + 2 live


# ---- 2. resource limits ----------------------------------------------------------------------------


def test_kv_ceilings_and_run_count_are_400s_naming_the_field_before_any_allocation(tiny_dir, monkeypatch):
    def no_allocation(*_, **__):
        raise AssertionError("a KV cache was allocated")

    with serving(tiny_dir, max_kv_memory_mb=1, max_run_kv_memory_mb=0.75, max_runs=2) as (client, manager):
        per_token = 2 * 2 * 2 * 16 * 4  # 2 layers, K and V, 2 KV heads of 16, fp32
        with monkeypatch.context() as m:
            m.setattr("kvscope.backend.engine.engine.KVCache", no_allocation)
            huge = client.post("/api/runs", json={"scenario": one_request(tiny_dir, num_blocks=1_000_000)})
            assert huge.status_code == 400 and huge.json()["field"] == "engine.num_blocks"
            assert "the server allows 0.75 MB per run (--max-run-kv-memory-mb)" in huge.json()["error"]
            budget = client.post("/api/runs", json={"scenario": {**one_request(tiny_dir, num_blocks=None,
                                                                             kv_cache_memory_mb=1e12)}})
            assert budget.status_code == 400 and budget.json()["field"] == "engine.kv_cache_memory_mb"
        blocks = int(0.6 * MB // (per_token * 4))  # 0.6 MB: one fits, two pass the 1 MB total
        body = {"scenario": one_request(tiny_dir, num_blocks=blocks), "paused": True}
        assert client.post("/api/runs", json=body).status_code == 201
        second = client.post("/api/runs", json=body)
        assert second.status_code == 400 and "--max-kv-memory-mb" in second.json()["error"]
        small = {"scenario": one_request(tiny_dir, num_blocks=4), "paused": True}
        assert client.post("/api/runs", json=small).status_code == 201
        third = client.post("/api/runs", json=small)
        assert third.status_code == 400 and "--max-runs" in third.json()["error"]


def test_a_paused_run_expires_and_frees_its_place(tiny_dir):
    with serving(tiny_dir, paused_ttl_s=0.3, max_runs=1) as (client, manager):
        body = {"scenario": one_request(tiny_dir), "paused": True}
        assert client.post("/api/runs", json=body).status_code == 201
        wait_for(lambda: not client.get("/api/runs").json())  # expired, forgotten
        assert client.post("/api/runs", json=body).status_code == 201  # it no longer holds the only place


def test_an_expired_run_is_forgotten_as_its_worker_ends_and_reading_the_runs_changes_nothing(tiny_dir):
    """Nobody lists the runs: the run's own worker tells the manager as it ends. And listing is a read:
    it returns the runs held, an expiring one included, and forgets none."""
    with serving(tiny_dir, paused_ttl_s=0.3) as (client, manager):
        run_id = client.post("/api/runs", json={"scenario": one_request(tiny_dir), "paused": True}).json()["run_id"]
        run = manager.get(run_id)
        wait_for(lambda: manager.get(run_id) is None, "the expired run forgotten without a listing")
        assert run.expired and run_id not in manager.kv_bytes
        held = manager.list()
        assert manager.list() == held == []


def test_a_paused_api_run_resumes_after_the_idle_time(tiny_dir):
    manager = RunManager(default_model=tiny_dir, limits=ServiceLimits(paused_ttl_s=0.3))
    api = manager.api_run()
    api.control("pause")
    api.add_request("ab", 1, None)
    wait_for(lambda: not api.pacing.paused)
    wait_for(lambda: any(r.status == "finished" for r in api.state.requests.values()))
    manager.stop_all()


# ---- 4. no server paths from the API -------------------------------------------------------------------


def test_scenarios_and_models_by_name_or_inline_never_by_path(tiny_dir, tmp_path):
    planted = tmp_path / "planted.yaml"
    planted.write_text("name: secret-line\nrequests: [\n")
    with serving(tiny_dir) as (client, manager):
        answers = [client.post("/api/runs", json={"scenario": name}).json()
                   for name in (str(planted), str(tmp_path / "absent.yaml"), "../scenarios/shared-prefix")]
        assert all(a["field"] == "scenario" for a in answers)
        texts = {a["error"].replace(repr(n), "NAME") for a, n in
                 zip(answers, (str(planted), str(tmp_path / "absent.yaml"), "../scenarios/shared-prefix"))}
        assert len(texts) == 1 and "secret-line" not in texts.pop()  # exists or not: the same words
        refused = client.post("/api/runs", json={"scenario": "shared-prefix", "overrides": {"model": str(tmp_path)}})
        assert refused.status_code == 400 and refused.json()["field"] == "model"
        inline = "\n".join(["name: inline", f"model: {tiny_dir}", "engine: {block_size: 4, num_blocks: 32}",
                            "requests: [{id: a, prompt: ab, max_tokens: 1}]"])
        assert client.post("/api/runs", json={"yaml": inline, "paused": True}).status_code == 201
        bad = client.post("/api/runs", json={"yaml": "name: x\nsecret: [\n"}).json()
        assert bad["field"] == "yaml" and "secret" not in bad["error"] and "line" in bad["error"]
    with serving(tiny_dir, allow_paths=True) as (client, manager):
        planted.write_text(json.dumps(one_request(tiny_dir)))
        assert client.post("/api/runs", json={"scenario": str(planted), "paused": True}).status_code == 201


# ---- 5. backpressure and cancellation ------------------------------------------------------------------


def test_a_full_waiting_queue_is_a_429_with_retry_after(tiny_dir):
    with serving(tiny_dir, max_waiting=1) as (client, manager):
        api = manager.api_run()
        api.control("pause")
        api.add_request("ab", 1, None)
        with pytest.raises(RunBusy):
            api.add_request("ab", 1, None)
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "--max-waiting" in r.json()["error"]["message"]
        live = client.post(f"/api/runs/{API_RUN_ID}/requests", json={"prompt": "ab", "max_tokens": 1})
        assert live.status_code == 429 and "retry-after" in live.headers


def test_a_request_past_the_time_limit_is_aborted(tiny_dir):
    with serving(tiny_dir, request_timeout_s=0.3) as (client, manager):
        manager.api_run().control("pause")
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with client.stream("POST", "/v1/completions", json={"prompt": "ab", "max_tokens": 4, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"


def test_a_non_streaming_request_whose_client_leaves_is_aborted_and_frees_its_blocks(tiny_dir):
    manager = RunManager(default_model=tiny_dir)
    with live_server(manager) as url:
        api = manager.api_run()
        api.control("step", 2)  # paused after admitting and prefilling: it holds blocks, generates no more
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 50, "ignore_eos": True},
                       timeout=1.0)
        wait_for(lambda: any(r.finish_reason == "abort" for r in api.state.requests.values()))
        assert not api.state.block_tables and not api.state.running


def test_viewers_are_capped(tiny_dir):
    with serving(tiny_dir, max_viewers=1) as (client, manager):
        run_id = client.post("/api/runs", json={"scenario": one_request(tiny_dir), "paused": True}).json()["run_id"]
        with client.websocket_connect(f"/ws/runs/{run_id}") as first:
            assert first.receive_json()["type"] == "snapshot"
            with pytest.raises(WebSocketDisconnect) as refused:
                with client.websocket_connect(f"/ws/runs/{run_id}") as second:
                    second.receive_json()
                    second.receive_json()
            assert refused.value.code == 4429


def test_sigterm_aborts_in_flight_requests_and_exits_while_paused(tiny_dir):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "NICEGUI"))}
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "serve", "--no-ui", "--port", str(port),
                             "--model", tiny_dir], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    chunks: list[dict] = []
    try:
        deadline = time.monotonic() + 90
        while "API on" not in (proc.stdout.readline() or ""):
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
        first = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 1}, timeout=30)
        assert first.status_code == 200  # the api run exists
        assert httpx.post(f"{url}/api/runs/api/control", json={"action": "pause"}, timeout=5).status_code == 200

        def stream() -> None:
            body = {"prompt": "ab", "max_tokens": 8, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as s:
                chunks.extend(json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {"))

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: httpx.get(f"{url}/api/runs/api", timeout=5).json()["waiting"])  # in flight, paused
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)  # a deadline, not the target: bench/latency.py measures the exit (within 5 s)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "abort"


def test_the_official_client_sees_a_full_queue_as_a_rate_limit(tiny_dir):
    import openai

    manager = RunManager(default_model=tiny_dir, limits=ServiceLimits(max_waiting=1))
    with live_server(manager) as url:
        api = manager.api_run()
        api.control("pause")
        api.add_request("ab", 1, None)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=tiny_dir, prompt="ab", max_tokens=1)


def test_serve_flags_set_the_limits_and_refuse_nonsense(capsys):
    from kvscope.cli import _limits, build_parser

    args = build_parser().parse_args(["serve", "--no-ui", "--max-kv-memory-mb", "512", "--max-waiting", "3",
                                      "--request-timeout-s", "2.5", "--max-viewers", "4", "--allow-paths",
                                      "--grammar-timeout-s", "7", "--max-grammar-compiles", "3",
                                      "--grammar-cache-mb", "64"])
    limits = _limits(args)
    assert (limits.max_kv_memory_mb, limits.max_waiting, limits.request_timeout_s, limits.max_viewers) == \
        (512, 3, 2.5, 4)
    assert (limits.grammar_timeout_s, limits.max_grammar_compiles, limits.grammar_cache_mb) == (7, 3, 64)
    assert limits.allow_paths and limits.served_models == ("demo",) and limits.max_runs == ServiceLimits().max_runs
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", "--max-waiting", "0"])
    assert refused.value.code == 2 and "--max-waiting: '0' is not a number > 0" in capsys.readouterr().err
    assert _limits(build_parser().parse_args(["serve", "--api-events", "off"])).api_events == "off"
    assert ServiceLimits().api_events == "full"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--api-events", "loud"])
    assert "--api-events: invalid choice: 'loud'" in capsys.readouterr().err


def test_limits_show_a_tensor_parallel_runs_other_ranks_with_their_bytes():
    """Rank processes hold weight shards and KV pools outside this process: /api/limits names them per run."""
    scenario = {"name": "tp", "model": "demo", "seed": 0, "engine": {"tensor_parallel": 2, "num_blocks": 64},
                "requests": [{"id": "r", "prompt": "ROMEO:\n", "max_tokens": 2}]}
    with serving("demo") as (client, manager):
        run_id = client.post("/api/runs", json={"scenario": scenario, "paused": True}).json()["run_id"]
        limits = client.get("/api/limits").json()
        (ranks,) = limits["rank_processes"]
        shards = [c for c in limits["weight_copies"] if c["rank_shards"]]
        assert ranks["run_id"] == run_id and ranks["processes"] == 1
        assert ranks["weight_bytes"] == sum(c["bytes"] for c in shards) > 0
        assert 0 < ranks["kv_bytes"] == manager.kv_bytes[run_id] // 2 <= limits["kv_bytes"] <= limits["max_kv_bytes"]
        assert client.delete(f"/api/runs/{run_id}").status_code == 204
        assert client.get("/api/limits").json()["rank_processes"] == []
