"""Weight copies are shared between runs of one model and settings, and counted by --max-weight-memory-mb.

Each test brings its own WeightCache, so that the copies other tests left in the process's cache do
not count. Servers bind 127.0.0.1 only (TestClient); every wait is bounded.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from litestar.testing import TestClient

from kvscope.backend.model.loader import load_model
from kvscope.backend.model.quant import QuantLinear, quantize_loaded
from kvscope.backend.model.weights import WeightCache, WeightKey
from kvscope.backend.server.limits import MB, ServiceLimits, model_config, weight_copy_bytes
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import in_process, one_request, wait_for


def int8(model: str, group_size: int) -> dict:
    return {"scenario": one_request(model, num_blocks=16, weight_quant="int8", quant_group_size=group_size),
            "paused": True}


@contextmanager
def serving_own_weights(model: str, **limits) -> Iterator[tuple[TestClient, RunManager, WeightCache, list[str]]]:
    """in_process on a server with its own weight cache: the client, the manager, the cache, and the list of
    model names that cache loaded from disk."""
    loads: list[str] = []
    cache = WeightCache(load=lambda name, weights: loads.append(name) or load_model(name, weights=weights))
    manager = RunManager(default_model=model, limits=ServiceLimits(**limits), weights=cache)
    with in_process(manager) as client:
        yield client, manager, cache, loads


def freed(copy: weakref.ref) -> bool:
    gc.collect()
    return copy() is None


def first_qweight(manager: RunManager, run_id: str):
    """The first quantized layer's codes in the model the run's engine computes with."""
    model = manager.get(run_id).engine.executor.runner.model
    return next(m for m in model.modules() if isinstance(m, QuantLinear)).qweight


def start(client: TestClient, body: dict) -> str:
    answer = client.post("/api/runs", json=body)
    assert answer.status_code == 201, answer.text
    return answer.json()["run_id"]


def test_two_runs_of_one_quantized_model_share_one_copy_and_the_second_adds_no_bytes(tiny_dir):
    with serving_own_weights(tiny_dir) as (client, manager, cache, loads):
        first = start(client, int8(tiny_dir, 32))
        held = cache.held_bytes()
        second = start(client, int8(tiny_dir, 32))
        assert first_qweight(manager, first).data_ptr() == first_qweight(manager, second).data_ptr()
        assert cache.held_bytes() == held
        assert loads == [tiny_dir]  # the model's own weights were read from disk once
        assert [(c["quant"], c["group_size"], c["runs"]) for c in cache.describe()] == [("none", None, 2),
                                                                                      ("int8", 32, 2)]


def test_another_group_size_is_another_copy_counted_by_its_own_bytes(tiny_dir):
    with serving_own_weights(tiny_dir) as (client, manager, cache, _):
        by_32 = start(client, int8(tiny_dir, 32))
        held = cache.held_bytes()
        by_16 = start(client, int8(tiny_dir, 16))
        assert first_qweight(manager, by_32).data_ptr() != first_qweight(manager, by_16).data_ptr()
        _, summary = quantize_loaded(load_model(tiny_dir), "int8", 16)
        assert cache.held_bytes() == held + summary["bytes"]


def test_runs_with_one_draft_model_share_its_weights(tiny_dir):
    draft = {"method": "draft", "draft_model": "demo-draft", "num_tokens": 2}
    body = {"scenario": one_request(tiny_dir, num_blocks=16, speculative=draft), "paused": True}
    with serving_own_weights(tiny_dir) as (client, manager, cache, loads):
        runs = [start(client, body) for _ in range(2)]
        drafts = [manager.get(r).engine.executor.proposer.runner.model.lm_head.weight for r in runs]
        assert drafts[0].data_ptr() == drafts[1].data_ptr()
        assert loads == [tiny_dir, "demo-draft"]


def test_a_copy_past_the_weight_limit_is_a_400_naming_the_flag_and_builds_nothing(tiny_dir, monkeypatch):
    config = model_config(tiny_dir)
    room = weight_copy_bytes(config) + weight_copy_bytes(config, "int8", 32)  # the model and one int8 copy
    with serving_own_weights(tiny_dir, max_weight_memory_mb=1.01 * room / MB) as (client, manager, cache, loads):
        start(client, int8(tiny_dir, 32))
        start(client, int8(tiny_dir, 32))  # shared: it needs no room
        before, built = cache.describe(), []

        def build(*args, **_):
            built.append(args)
            raise AssertionError("built past the limit")

        with monkeypatch.context() as m:
            m.setattr("kvscope.backend.model.weights.quantize_loaded", build)
            m.setattr("kvscope.backend.engine.engine.KVCache", build)
            refused = client.post("/api/runs", json=int8(tiny_dir, 16))
            assert refused.status_code == 400 and refused.json()["field"] == "engine.weight_quant"
            assert "(--max-weight-memory-mb)" in refused.json()["error"]
            v1 = client.post("/v1/completions", json={"model": "demo-draft", "prompt": "ab", "max_tokens": 1})
            assert v1.status_code == 400 and v1.json()["error"]["param"] == "model"
            assert "--max-weight-memory-mb" in v1.json()["error"]["message"]
        assert cache.describe() == before and loads == [tiny_dir] and built == []


def test_a_finished_run_is_forgotten_to_make_room_for_a_new_copy(tiny_dir):
    config = model_config(tiny_dir)
    room = 1.2 * (weight_copy_bytes(config) + weight_copy_bytes(config, "int8", 32))  # not for a second int8 copy
    with serving_own_weights(tiny_dir, max_weight_memory_mb=room / MB) as (client, manager, cache, _):
        done = start(client, {**int8(tiny_dir, 32), "paused": False, "speed": 0})
        wait_for(lambda: manager.get(done).finished, "the run finished")
        start(client, int8(tiny_dir, 16))
        assert manager.get(done) is None
        assert [(c["quant"], c["group_size"]) for c in cache.describe()] == [("none", None), ("int8", 16)]


def test_a_run_that_cannot_build_lets_go_of_what_it_reserved(tiny_dir):
    with serving_own_weights(tiny_dir) as (client, manager, cache, _):
        refused = client.post("/api/runs", json=int8(tiny_dir, 48))  # 48 does not divide the width 64
        assert refused.status_code == 400 and refused.json()["field"] == "engine.quant_group_size"
        assert cache.describe() == [] and client.get("/api/limits").json()["runs"] == 0


def test_the_accounting_returns_to_baseline_and_the_copy_is_freed_when_the_runs_are_gone(tiny_dir):
    with serving_own_weights(tiny_dir, paused_ttl_s=0.2) as (client, manager, cache, _):
        runs = [start(client, int8(tiny_dir, 32)) for _ in range(2)]
        copy = weakref.ref(manager.get(runs[0]).engine.executor.runner.model)
        assert cache.held_bytes() > 0
        wait_for(lambda: not client.get("/api/runs").json(), "both paused runs expired (untouched) and were forgotten")
        assert cache.held_bytes() == 0 and cache.describe() == []
        assert client.get("/api/limits").json()["weight_bytes"] == 0
        # the forgotten runs' worker threads end, then nothing refers to the copy
        wait_for(lambda: freed(copy), "nothing refers to the quantized copy")


def test_the_limits_route_reports_the_kv_and_weight_bytes_held_and_allowed(tiny_dir):
    limits = {"max_kv_memory_mb": 64, "max_weight_memory_mb": 32, "max_runs": 5}
    with serving_own_weights(tiny_dir, **limits) as (client, manager, cache, _):
        start(client, int8(tiny_dir, 32))
        held = client.get("/api/limits").json()
        per_token = 2 * 2 * 2 * 16 * 4  # 2 layers, K and V, 2 KV heads of 16, fp32
        assert (held["runs"], held["max_runs"]) == (1, 5)
        assert (held["kv_bytes"], held["max_kv_bytes"]) == (16 * 4 * per_token, 64 * MB)
        assert (held["weight_bytes"], held["max_weight_bytes"]) == (cache.held_bytes(), 32 * MB)
        assert [(c["model"], c["quant"], c["group_size"], c["runs"], c["built"]) for c in held["weight_copies"]] == \
            [(tiny_dir, "none", None, 1, True), (tiny_dir, "int8", 32, 1, True)]


def test_the_estimate_is_the_cost_models_formula_within_a_fraction_of_the_built_copy():
    demo = load_model("demo")
    config = model_config("demo")
    for quant, group in (("none", 0), ("int8", 64), ("int4", 32), ("int8", 0)):
        _, summary = quantize_loaded(demo, quant, group)
        assert 0.997 < weight_copy_bytes(config, quant, group) / summary["bytes"] <= 1.0  # norms are left out


def test_a_headless_cache_keeps_what_nobody_holds_until_a_holder_lets_go(tiny_dir):
    cache = WeightCache()
    loaded = cache.model(tiny_dir)
    assert cache.model(tiny_dir) is loaded and cache.quantized(loaded, "int8", 32)[0] is \
        cache.quantized(loaded, "int8", 32)[0]
    cache.hold("run", {WeightKey(tiny_dir): 1})
    cache.release("run")
    assert cache.describe() == []


def test_the_weight_limit_is_a_serve_flag_with_a_quarter_of_memory_by_default():
    from kvscope.backend.server.limits import physical_memory_mb
    from kvscope.cli import _limits, build_parser

    assert _limits(build_parser().parse_args(["serve", "--max-weight-memory-mb", "300"])).max_weight_memory_mb == 300
    assert ServiceLimits().max_weight_memory_mb == physical_memory_mb() / 4
