"""Driven from the OpenAPI document with generated inputs: nothing a client sends gets a 5xx."""

import json
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from kvscope.backend.server.app import create_app
from kvscope.backend.server.manager import RunManager

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def api(tiny_dir):
    manager = RunManager(default_model=tiny_dir)
    with TestClient(create_app(manager), base_url="http://127.0.0.1:8000") as client:
        run_id = client.post("/api/runs", json={"scenario": {
            "name": "fuzz", "model": tiny_dir, "engine": {"block_size": 4, "num_blocks": 64},
            "requests": [{"id": "a", "prompt": "x", "max_tokens": 2}]}, "paused": True}).json()["run_id"]
        operations = [(path, method, spec) for path, item in client.get("/schema/openapi.json").json()["paths"].items()
                      for method, spec in item.items() if method in ("get", "post")]
        yield client, run_id, operations
    manager.stop_all()


def valid_body(path: str, run_id: str) -> dict:
    """A body that passes validation, to be mutated field by field."""
    if path.endswith("/control"):
        return {"action": "step", "value": 1}
    if path.endswith("/requests"):
        return {"prompt": "KING:", "max_tokens": 2, "sampling": {"temperature": 0}}
    if path == "/api/runs":
        return {"scenario": "shared-prefix", "overrides": {"engine.num_blocks": 8}, "paused": True}
    if "completions" in path:
        return {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    return {}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_generated_request_gets_a_server_error(api, data):
    client, run_id, operations = api
    path, method, spec = data.draw(st.sampled_from(operations))
    # Path parameters: the real run, or anything at all.
    param = data.draw(st.sampled_from([run_id, "api-nope"]) | st.text(min_size=1, max_size=12))
    param = quote(param, safe="")
    url = path.replace("{run_id}", param).replace("{name}", param).replace("{model_id}", param)
    if method == "get":
        status = client.get(url).status_code
    else:
        body = valid_body(path, run_id)
        kind = data.draw(st.sampled_from(["mutate", "replace", "raw"]))
        if kind == "mutate" and body:
            body[data.draw(st.sampled_from(sorted(body) + ["unknown"]))] = data.draw(json_values)
            payload = json.dumps(body).encode()
        elif kind == "replace":
            payload = json.dumps(data.draw(json_values)).encode()
        else:
            payload = data.draw(st.binary(max_size=64))
        status = client.post(url, content=payload, headers={"content-type": "application/json"}).status_code
    assert status < 500, f"{method.upper()} {url} -> {status}"


def hostile_value(kind: str, size: int) -> str:
    """JSON text (built as text: json.dumps itself would overflow its stack on the deepest ones)."""
    if kind == "deep_list":
        return "[" * size + "]" * size
    if kind == "deep_object":
        return '{"a":' * size + "1" + "}" * size
    if kind == "long_string":
        return json.dumps("x" * size * 100)
    if kind == "long_list":
        return "[" + ",".join(["1"] * size) + "]"
    if kind == "wide_object":
        return "{" + ",".join(f'"k{i}":1' for i in range(size)) + "}"
    return "1" + "0" * min(size, 400)  # a huge number


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deep_or_oversized_fields_get_a_4xx(api, data):
    """Any field of any body, made too deep (up to 3000 levels) or too big: a 4xx, never a 5xx."""
    client, run_id, operations = api
    path = data.draw(st.sampled_from(sorted({p for p, method, _ in operations if method == "post"})))
    body = valid_body(path, run_id)
    field = data.draw(st.sampled_from(sorted(body) + ["unknown"]))
    kind = data.draw(st.sampled_from(["deep_list", "deep_object", "long_string", "long_list", "wide_object",
                                      "huge_number"]))
    size = data.draw(st.integers(1, 3000))
    rest = json.dumps({k: v for k, v in body.items() if k != field})
    payload = rest[:-1] + ("," if len(rest) > 2 else "") + f'"{field}":{hostile_value(kind, size)}}}'
    url = path.replace("{run_id}", run_id)
    status = client.post(url, content=payload, headers={"content-type": "application/json"}).status_code
    assert status < 500, f"POST {url} {field}={kind}({size}) -> {status}"
    if kind.startswith("deep") and size > 32:
        assert status == 400
