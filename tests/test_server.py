"""The service: routes, controls, replay, security. Litestar's test client; real servers elsewhere."""

import json

import pytest
from litestar.exceptions import WebSocketDisconnect
from litestar.testing import TestClient

from kvscope.backend.server.app import create_app
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import JSON, LOCAL, in_process, scenario, settled_snapshot, wait_for


@pytest.fixture
def client(tiny_dir):
    with in_process(RunManager(default_model=tiny_dir)) as c:  # the server's own model: clients may name it
        yield c


def test_health_scenarios_and_openapi(client):
    assert client.get("/api/health").json()["status"] == "ok"
    names = [s["name"] for s in client.get("/api/scenarios").json()]
    assert "shared-prefix" in names
    assert client.get("/api/scenarios/shared-prefix").json()["name"] == "shared-prefix"
    assert client.get("/api/scenarios/nope").status_code == 404
    assert client.get("/api/scenarios/..%2F..%2Fpyproject").status_code == 404
    doc = client.get("/schema/openapi.json").json()
    assert "/api/runs/{run_id}/control" in doc["paths"]


def test_paused_run_steps_exactly_one_iteration_per_step(client, tiny_dir):
    run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "paused": True, "speed": 0}).json()["run_id"]
    assert client.get(f"/api/runs/{run_id}").json()["step"] == -1
    for expected in (0, 1, 2):
        client.post(f"/api/runs/{run_id}/control", json={"action": "step"})
        wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["step"] == expected)
    assert settled_snapshot(client, run_id)["step"] == 2  # paused: nothing more happened
    client.post(f"/api/runs/{run_id}/control", json={"action": "resume"})
    wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
    snap = client.get(f"/api/runs/{run_id}").json()
    assert all(r["status"] == "finished" for r in snap["requests"].values())
    assert len(snap["free_blocks"]) == 128


def test_speed_paces_iterations(client, tiny_dir):
    """At ten iterations a second, iteration j starts at least (j - i - 1) / 10 s after iteration i ended, by
    the engine's own clock: each start waits a tenth of a second after the one before, which waited for the
    end of the iteration before it. A loaded machine only spreads them further apart (how close the pace
    comes to ten a second is a wall-clock figure: bench/, not a test)."""
    run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "speed": 10}).json()["run_id"]
    assert client.get(f"/api/runs/{run_id}").json()["speed"] == 10
    wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
    trace = [json.loads(line) for line in client.get(f"/api/runs/{run_id}/trace").text.splitlines()]
    ends = [e["t"] for e in trace if e["type"] == "iteration"]  # stamped as the iteration's event is sent
    starts = [e["t"] - e["duration_s"] for e in trace if e["type"] == "iteration"]
    early = [(i, j) for i in range(len(ends)) for j in range(i + 2, len(ends))
             if starts[j] - ends[i] < (j - i - 1) / 10 - 1e-6]
    assert len(ends) >= 6 and early == [], f"iterations (i, j) closer than the pace allows: {early[:5]}"


def test_live_requests_join_and_bad_ones_are_refused(client, tiny_dir):
    run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "paused": True}).json()["run_id"]
    ok = client.post(f"/api/runs/{run_id}/requests", json={"prompt": "KING:", "max_tokens": 3})
    assert ok.status_code == 201
    too_long = client.post(f"/api/runs/{run_id}/requests", json={"prompt": "KING: " * 600, "max_tokens": 3})
    assert too_long.status_code == 400 and too_long.json()["field"] == "prompt"
    bad = client.post(f"/api/runs/{run_id}/requests", json={"prompt": "x", "sampling": {"temperature": -2}})
    assert bad.status_code == 400 and bad.json()["field"] == "sampling.temperature"
    client.post(f"/api/runs/{run_id}/control", json={"action": "resume", "value": None})
    client.post(f"/api/runs/{run_id}/control", json={"action": "speed", "value": 0})
    wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
    requests = client.get(f"/api/runs/{run_id}").json()["requests"]
    assert requests[ok.json()["request_id"]]["status"] == "finished"


def test_dist_route_serves_a_tokens_whole_raw_distribution_and_refuses_bad_ids(client, tiny_dir):
    import base64

    import numpy as np

    run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "speed": 0}).json()["run_id"]
    wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
    trace = client.get(f"/api/runs/{run_id}/trace").text
    token = next(e for e in map(json.loads, trace.splitlines()) if e["type"] == "token")
    where = {"request_id": token["request_id"], "seq_id": token["seq_id"], "position": token["position"]}
    r = client.get(f"/api/runs/{run_id}/dist", params=where)
    assert r.status_code == 200 and r.json()["vocab_size"] == 2048
    row = np.frombuffer(base64.b64decode(r.json()["raw_probs_f32"]), dtype="<f4")
    assert len(row) == 2048 and abs(row.sum() - 1) < 1e-5
    assert [float(row[t[0]]) for t in token["dist"]["top"]] == pytest.approx([t[2] for t in token["dist"]["top"]])
    for bad, status in (({"position": -1}, 400), ({"position": "x"}, 400), ({"position": 2**40}, 400),
                        ({"seq_id": -1}, 400), ({"request_id": "x" * 300}, 400), ({"request_id": "nope"}, 404),
                        ({"position": token["position"] + 10_000}, 404)):
        answer = client.get(f"/api/runs/{run_id}/dist", params={**where, **bad})
        assert answer.status_code == status, (bad, answer.text)
        assert "error" in answer.json()
    assert client.get(f"/api/runs/{run_id}/dist", params={"request_id": "r0", "seq_id": 0}).status_code == 400
    assert client.get("/api/runs/nope/dist", params=where).status_code == 404
    replay = client.post("/api/runs", json={"trace": trace, "speed": 0}).json()["run_id"]
    assert client.get(f"/api/runs/{replay}/dist", params=where).status_code == 404  # a trace has only the top tokens


def test_trace_replays_with_pause_step_and_seek(client, tiny_dir):
    run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "speed": 0}).json()["run_id"]
    wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
    original = client.get(f"/api/runs/{run_id}").json()
    trace = client.get(f"/api/runs/{run_id}/trace").text
    replay = client.post("/api/runs", json={"trace": trace, "paused": True, "speed": 0}).json()
    assert replay["kind"] == "replay"
    rid = replay["run_id"]
    client.post(f"/api/runs/{rid}/control", json={"action": "step"})
    wait_for(lambda: client.get(f"/api/runs/{rid}").json()["step"] == 0)
    client.post(f"/api/runs/{rid}/control", json={"action": "seek", "value": 5})
    seeked = client.get(f"/api/runs/{rid}").json()
    assert seeked["step"] == 4  # the state just before iteration 5 runs
    client.post(f"/api/runs/{rid}/control", json={"action": "resume"})
    wait_for(lambda: client.get(f"/api/runs/{rid}").json()["finished"])
    final = client.get(f"/api/runs/{rid}").json()
    for key in ("block_tables", "free_blocks", "ref_counts", "requests", "step"):
        assert final[key] == original[key], key


def test_bad_input_gets_4xx_naming_the_problem(client, tiny_dir):
    assert client.get("/api/runs/nope").status_code == 404
    assert client.post("/api/runs/nope/control", json={"action": "pause"}).status_code == 404
    r = client.post("/api/runs", json={"scenario": {**scenario(tiny_dir), "engine": {"block_sise": 4}}})
    assert r.status_code == 400 and "engine.block_sise" in r.json()["error"]
    r = client.post("/api/runs", json={"scenario": "shared-prefix", "overrides": {"engine.block_size": 0}})
    assert r.status_code == 400 and "engine.block_size" in r.json()["error"]
    assert client.post("/api/runs", json={"scenario": "../../etc/passwd"}).status_code == 400
    assert client.post("/api/runs", json={"trace": "not json\n"}).status_code == 400
    assert client.post("/api/runs", content=b"{nope", headers=JSON).status_code == 400
    assert client.post("/api/runs", json={"speed": -1, "scenario": "shared-prefix"}).status_code == 400
    run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "paused": True}).json()["run_id"]
    r = client.post(f"/api/runs/{run_id}/control", json={"action": "explode"})
    assert r.status_code == 400 and r.json()["field"] == "action"
    assert client.post(f"/api/runs/{run_id}/control", json={"action": "seek", "value": 3}).status_code == 400


def test_token_guards_changes_but_not_watching(tiny_dir):
    manager = RunManager(default_model=tiny_dir)
    with TestClient(create_app(manager, token="s3cret"), base_url=LOCAL) as c:
        body = {"scenario": scenario(tiny_dir), "paused": True}
        assert c.post("/api/runs", json=body).status_code == 401
        run_id = c.post("/api/runs", json=body, headers={"Authorization": "Bearer s3cret"}).json()["run_id"]
        assert c.get(f"/api/runs/{run_id}").status_code == 200
        assert c.get(f"/api/runs/{run_id}/trace").status_code == 200
        assert c.post(f"/api/runs/{run_id}/control", json={"action": "step"}).status_code == 401
    manager.stop_all()


def test_body_size_limit_and_no_cors_by_default(tiny_dir):
    with TestClient(create_app(RunManager(), max_body_bytes=2000), base_url=LOCAL) as c:
        big = c.post("/api/runs", content=json.dumps({"trace": "x" * 5000}), headers={"content-type": "application/json"})
        assert big.status_code == 413
        r = c.get("/api/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_speculative_run_with_live_parallel_and_beam_requests(client, tiny_dir):
    """A run started with speculative decoding takes n > 1 requests live; beam search is refused there
    (it cannot be speculated) and works in a plain run; the trace shows forks, drafts and outputs."""
    spec = {"speculative": {"method": "ngram", "num_tokens": 3}}
    run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir, **spec), "paused": True}).json()["run_id"]
    multi = client.post(f"/api/runs/{run_id}/requests",
                        json={"prompt": "KING:", "max_tokens": 5, "sampling": {"temperature": 1.0, "seed": 1, "n": 3}})
    assert multi.status_code == 201
    beams = client.post(f"/api/runs/{run_id}/requests", json={"prompt": "KING:", "sampling": {"beam_width": 2}})
    assert beams.status_code == 400 and beams.json()["field"] == "sampling.beam_width"
    client.post(f"/api/runs/{run_id}/control", json={"action": "speed", "value": 0})
    client.post(f"/api/runs/{run_id}/control", json={"action": "resume", "value": None})
    wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
    events = [json.loads(line) for line in client.get(f"/api/runs/{run_id}/trace").text.splitlines()]
    rid = multi.json()["request_id"]
    assert len([e for e in events if e["type"] == "seq_fork" and e["request_id"] == rid]) == 2
    done = next(e for e in events if e["type"] == "request_finished" and e["request_id"] == rid)
    assert len(done["outputs"]) == 3
    assert events[0]["config"]["speculative"]["method"] == "ngram"

    plain = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "paused": True}).json()["run_id"]
    ok = client.post(f"/api/runs/{plain}/requests", json={"prompt": "KING:", "max_tokens": 4,
                                                           "sampling": {"beam_width": 2, "n": 2}})
    assert ok.status_code == 201
    client.post(f"/api/runs/{plain}/control", json={"action": "speed", "value": 0})
    client.post(f"/api/runs/{plain}/control", json={"action": "resume", "value": None})
    wait_for(lambda: client.get(f"/api/runs/{plain}").json()["finished"])
    events = [json.loads(line) for line in client.get(f"/api/runs/{plain}/trace").text.splitlines()]
    done = next(e for e in events if e["type"] == "request_finished" and e["request_id"] == ok.json()["request_id"])
    assert len(done["outputs"]) == 2 and done["outputs"][0]["score"] >= done["outputs"][1]["score"]


# ---- cross-site safety (guards.py) ---------------------------------------------------------------------


def test_bodies_that_a_browser_sends_cross_site_without_a_preflight_are_refused(client, tiny_dir):
    """text/plain, form and multipart bodies used to be parsed as JSON and executed: a page on any site
    could start runs on a localhost server. Now they are a 415 and nothing starts."""
    body = json.dumps({"scenario": scenario(tiny_dir), "paused": True})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": content_type} if content_type else {}
        r = client.post("/api/runs", content=body, headers=headers)
        assert r.status_code == 415 and "application/json" in r.json()["error"], content_type
    assert client.get("/api/runs").json() == []
    ok = client.post("/api/runs", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 201


def test_on_a_loopback_bind_the_host_must_be_a_loopback_name(client):
    for host in ("localhost", "localhost:8000", "127.0.0.1", "127.0.0.1:9", "[::1]", "[::1]:8000"):
        assert client.get("/api/health", headers={"host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io", ""):
        r = client.get("/api/runs", headers={"host": host})
        assert r.status_code == 403 and "Host" in r.json()["error"], host
    with TestClient(create_app(RunManager(), host="0.0.0.0", token="t"), base_url="http://my.server:8000") as c:
        assert c.get("/api/health").status_code == 200  # off loopback any name reaches it (the token guards it)


def test_a_cross_site_origin_may_not_change_runs(tiny_dir):
    manager = RunManager(default_model=tiny_dir)
    app = create_app(manager, cors_origins=["http://ok.example"], dashboard_origin="http://127.0.0.1:8080")
    body = {"scenario": scenario(tiny_dir), "paused": True}
    with TestClient(app, base_url=LOCAL) as c:
        refused = c.post("/api/runs", json=body, headers={"origin": "http://evil.example"})
        assert refused.status_code == 403 and "Origin" in refused.json()["error"]
        assert c.post("/api/runs", json=body, headers={"origin": "null"}).status_code == 403
        assert c.get("/api/runs", headers={"origin": "http://evil.example"}).status_code == 200  # reading: CORS's job
        for origin in ("http://ok.example", "http://127.0.0.1:8080", LOCAL, None):  # listed, dashboard, own, none
            headers = {"origin": origin} if origin else {}
            assert c.post("/api/runs", json=body, headers=headers).status_code == 201, origin
        run_id = c.get("/api/runs").json()[0]["run_id"]
        with pytest.raises(WebSocketDisconnect) as refused:  # a page of another site may not read the events either
            with c.websocket_connect(f"/ws/runs/{run_id}", headers={"origin": "http://evil.example"}) as ws:
                ws.receive_json()
        assert refused.value.code == 4403
        with c.websocket_connect(f"/ws/runs/{run_id}") as ws:
            assert ws.receive_json()["type"] == "snapshot"
    manager.stop_all()


def test_off_loopback_watching_needs_the_token_unless_public_watch(tiny_dir):
    auth = {"Authorization": "Bearer s3cret"}
    for public_watch in (False, True):
        manager = RunManager(default_model=tiny_dir)
        with TestClient(create_app(manager, token="s3cret", host="0.0.0.0", public_watch=public_watch),
                        base_url="http://my.server:8000") as c:
            run_id = c.post("/api/runs", json={"scenario": scenario(tiny_dir), "paused": True},
                            headers=auth).json()["run_id"]
            watching = (f"/api/runs/{run_id}", f"/api/runs/{run_id}/trace", "/api/runs")
            for path in watching:
                assert c.get(path, headers=auth).status_code == 200, path
                assert c.get(path).status_code == (200 if public_watch else 401), path
            assert c.get("/api/scenarios").status_code == 200  # not a run: open
            with c.websocket_connect(f"/ws/runs/{run_id}", headers=auth) as ws:
                assert ws.receive_json()["type"] == "snapshot"
            if not public_watch:
                with pytest.raises(WebSocketDisconnect) as refused:
                    with c.websocket_connect(f"/ws/runs/{run_id}") as ws:
                        ws.receive_json()
                assert refused.value.code == 4401
        manager.stop_all()


def test_loopback_names_with_and_without_ports():
    from kvscope.backend.server.guards import is_loopback_name

    assert all(map(is_loopback_name, ("localhost", "LOCALHOST:1", "127.0.0.1", "127.1.2.3:80", "[::1]", "[::1]:80")))
    assert not any(map(is_loopback_name, ("::1", "[::2]", "10.0.0.1", "localhost.x", "a:b:c", "[::1]x", "")))


# ---- hostile input ------------------------------------------------------------------------------------------


def test_deep_json_is_a_400_not_a_server_error(client):
    """100k nested arrays overflowed the decoder's stack: a RecursionError and a 500."""
    for path in ("/api/runs", "/api/runs/x/control", "/v1/completions", "/v1/chat/completions"):
        deep = '{"overrides": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}"
        r = client.post(path, content=deep, headers=JSON)
        assert r.status_code == 400 and "nested deeper than 32" in r.text, path
    just_deep_enough = '{"scenario": "nope", "overrides": {"a": ' + "[" * 30 + "]" * 30 + "}}"
    assert "nested" not in client.post("/api/runs", content=just_deep_enough, headers=JSON).text


def test_every_field_is_bounded(client, tiny_dir):
    too_many = {f"engine.x{i}": 1 for i in range(65)}
    r = client.post("/api/runs", json={"scenario": "shared-prefix", "overrides": too_many})
    assert r.status_code == 400 and r.json()["field"] == "overrides"
    r = client.post("/api/runs", json={"scenario": "s" * 129})
    assert r.status_code == 400 and r.json()["field"] == "scenario"
    run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "paused": True}).json()["run_id"]
    r = client.post(f"/api/runs/{run_id}/requests", json={"prompt": "x", "sampling": {f"k{i}": 1 for i in range(33)}})
    assert r.status_code == 400 and r.json()["field"] == "sampling"
    r = client.post(f"/api/runs/{run_id}/requests", json={"prompt": "x" * 100_001})
    assert r.status_code == 400 and r.json()["field"] == "prompt"
    r = client.post(f"/api/runs/{run_id}/control", json={"action": "step", "value": 1e300})
    assert r.status_code == 400 and r.json()["field"] == "value"


# ---- the trace reader ---------------------------------------------------------------------------------------


def finished_trace(client, tiny_dir) -> str:
    run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "speed": 0}).json()["run_id"]
    wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
    return client.get(f"/api/runs/{run_id}/trace").text


def test_a_trace_cut_mid_line_keeps_every_complete_line(client, tiny_dir, tmp_path, caplog):
    """A run killed while writing leaves half a line: the trace still reads, up to where it stopped."""
    from kvscope.backend.events.trace import TraceError, read_trace

    lines = finished_trace(client, tiny_dir).splitlines()
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    events = read_trace(path)
    assert [json.dumps(e, separators=(",", ":")) for e in events] == lines[:-1]
    assert f"{path}:{len(lines)}: the last line is cut short" in caplog.text
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10] + "\n")  # ended by a newline: corrupt, not cut
    with pytest.raises(TraceError, match=rf"^{path}:{len(lines)}: not JSON"):
        read_trace(path)
    r = client.post("/api/runs", json={"trace": "\n".join(lines)[:-5], "paused": True})
    assert r.status_code == 201  # replays what was complete


def test_a_trace_with_steps_out_of_order_names_the_line(client, tiny_dir):
    lines = finished_trace(client, tiny_dir).splitlines()
    late = next(i for i, line in enumerate(lines) if json.loads(line)["step"] >= 2)
    swapped = lines[:1] + [lines[late]] + lines[1:late] + lines[late + 1:]
    r = client.post("/api/runs", json={"trace": "\n".join(swapped) + "\n"})
    assert r.status_code == 400
    assert r.json()["error"].startswith("trace:3: step ") and "in step order" in r.json()["error"]


def run_through_lesson(client, run_id: str) -> list[int]:
    """Resume at every pause until the run ends; the steps it held at (each held for real)."""
    held = []
    for _ in range(20):  # bounded: memory-pressure's lesson pauses twice
        wait_for(lambda: (d := client.get(f"/api/runs/{run_id}").json())["paused"] or d["finished"])
        snap = client.get(f"/api/runs/{run_id}").json()
        if snap["finished"]:
            return held
        assert settled_snapshot(client, run_id)["step"] == snap["step"]  # held: nothing more ran
        held.append(snap["step"])
        assert client.post(f"/api/runs/{run_id}/control", json={"action": "resume"}).status_code == 200
    raise AssertionError("the lesson never let the run finish")


def test_lesson_mode_holds_an_unpaced_run_right_after_each_moment_its_lesson_explains(client, tiny_dir):
    from kvscope.backend.events.moments import find_moments, lesson_moments

    body = {"scenario": "memory-pressure", "overrides": {"model": tiny_dir}, "speed": 0, "lesson": True}
    run_id = client.post("/api/runs", json=body).json()["run_id"]
    assert client.get(f"/api/runs/{run_id}").json()["lesson"] is True
    held = run_through_lesson(client, run_id)
    trace = client.get(f"/api/runs/{run_id}/trace").text
    events = [json.loads(line) for line in trace.splitlines()]
    explained = [m for m in find_moments(events) if m.kind in lesson_moments(events[0]["scenario"])]
    assert [m.kind for m in explained] == ["preempt", "recompute"]
    assert held == [m.step for m in explained]  # exactly there, unpaced: the next iteration had not run
    pauses = [e for e in events if e["type"] == "control" and e["action"] == "pause"]
    assert [(e["value"], e["step"]) for e in pauses] == [(m.kind, m.step) for m in explained]

    # The recorded run replayed in lesson mode holds at the same iterations; seeking back shows them again.
    replay = client.post("/api/runs", json={"trace": trace, "speed": 0, "lesson": True}).json()["run_id"]
    assert run_through_lesson(client, replay) == held
    for action in ({"action": "pause"}, {"action": "seek", "value": 0}, {"action": "resume"}):
        client.post(f"/api/runs/{replay}/control", json=action)
    assert run_through_lesson(client, replay) == held


def test_lesson_mode_off_or_switched_off_lets_the_run_go_on(client, tiny_dir):
    body = {"scenario": "memory-pressure", "overrides": {"model": tiny_dir}, "speed": 0}
    plain = client.post("/api/runs", json=body).json()["run_id"]  # lesson mode is asked for, not the default
    assert run_through_lesson(client, plain) == []
    run_id = client.post("/api/runs", json={**body, "lesson": True, "paused": True}).json()["run_id"]
    assert client.post(f"/api/runs/{run_id}/control", json={"action": "lesson", "value": 0}).status_code == 200
    client.post(f"/api/runs/{run_id}/control", json={"action": "resume"})
    assert run_through_lesson(client, run_id) == []
    assert client.get(f"/api/runs/{run_id}").json()["lesson"] is False
    bad = client.post(f"/api/runs/{run_id}/control", json={"action": "lesson", "value": 2})
    assert bad.status_code == 400 and bad.json()["field"] == "value"


def test_a_scenario_runs_snapshot_carries_its_past_only_for_a_watcher_that_asks(client, tiny_dir):
    """The dashboard asks (`?past=1`) to draw a run it joins late from step 0; other clients get the
    snapshot alone: a past of several MB would pass most clients' default 1 MiB frame limit."""
    body = {"scenario": "memory-pressure", "overrides": {"model": tiny_dir}, "speed": 0}
    run_id = client.post("/api/runs", json=body).json()["run_id"]
    wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["finished"])
    trace = [json.loads(line) for line in client.get(f"/api/runs/{run_id}/trace").text.splitlines()]
    with client.websocket_connect(f"/ws/runs/{run_id}") as ws:
        assert "past" not in ws.receive_json()
    with client.websocket_connect(f"/ws/runs/{run_id}?past=1") as ws:
        assert ws.receive_json()["past"] == trace
