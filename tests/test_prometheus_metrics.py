"""GET /metrics (backend/server/metrics.py): vLLM's metric names and types, numbers that add up to the
responses' usage, and the very figures the dashboard shows for the API's run."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvscope.backend.events.record import RunRecord
from kvscope.backend.server.app import create_app
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.metrics import ServerMetrics
from tests.server_helpers import manager, model_name, url  # noqa: F401 (fixtures)

# Every metric docs/api.md lists, with its type as the parser names it (counters without `_total`).
DOCUMENTED = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:spec_decode_num_drafts": "counter", "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter", "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
    "kvscope_events_emitted": "counter", "kvscope_dashboard_viewers": "gauge", "kvscope_runs": "gauge",
}
REQUEST_HISTOGRAMS = ("vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                      "vllm:request_generation_tokens", "vllm:request_params_max_tokens", "vllm:request_params_n")
LONG_PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet"


class Scrape:
    """One /metrics answer, parsed by the official client's parser."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample: str, **labels: str) -> float:
        """The sum of the samples of that name whose labels include these."""
        family = self.families[sample.removesuffix("_total").removesuffix("_sum").removesuffix("_count")]
        return sum(s.value for s in family.samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))




def complete(url: str, body: dict) -> dict:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status().json()


def complete_streamed(url: str, body: dict) -> dict:
    """A streamed completion's usage (from its last chunk)."""
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
    assert usage is not None
    return usage


def settled(url: str, run_id: str = "api") -> tuple[dict, Scrape]:
    """The run's snapshot and a scrape taken while nothing moved (the seq is the same before and after)."""
    deadline = time.monotonic() + 30
    while True:
        before = httpx.get(f"{url}/api/runs/{run_id}", timeout=10).json()
        scrape = Scrape(httpx.get(f"{url}/metrics", timeout=10).text)
        after = httpx.get(f"{url}/api/runs/{run_id}", timeout=10).json()
        if before["seq"] == after["seq"]:
            return after, scrape
        assert time.monotonic() < deadline, "the API run never settled"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served(url: str, model_name: str) -> dict:
    """A plain, a streamed and an n = 2 completion, and one that repeats a prompt (prefix hits)."""
    base = {"model": model_name, "prompt": LONG_PROMPT, "temperature": 0}
    answers = [complete(url, {**base, "max_tokens": 12, "ignore_eos": True}),
               complete(url, {**base, "max_tokens": 6, "stop": ["\n"]}),  # the same prompt again: prefix hits
               complete(url, {**base, "prompt": "JULIET:\n", "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3})]
    usages = [a["usage"] for a in answers]
    usages.append(complete_streamed(url, {**base, "prompt": "HAMLET:", "max_tokens": 7, "ignore_eos": True}))
    # a request's finish reason is its first sequence's
    reasons = [a["choices"][0]["finish_reason"] for a in answers] + ["length"]
    snapshot, scrape = settled(url)
    return {"usages": usages, "reasons": reasons, "snapshot": snapshot, "scrape": scrape}


def test_every_documented_metric_is_there_with_its_type(served: dict) -> None:
    families = served["scrape"].families
    missing = set(DOCUMENTED) - set(families)
    assert not missing
    assert {name: families[name].type for name in DOCUMENTED} == DOCUMENTED


def test_documented_means_in_docs_api_md() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    assert [name for name in DOCUMENTED if f"`{name}" not in text] == []


def test_token_counters_are_the_sum_of_the_responses_usage(served: dict, model_name: str) -> None:
    scrape, usages = served["scrape"], served["usages"]
    labels = {"model_name": model_name, "engine": "0"}
    assert scrape.value("vllm:prompt_tokens_total", **labels) == sum(u["prompt_tokens"] for u in usages)
    assert scrape.value("vllm:generation_tokens_total", **labels) == sum(u["completion_tokens"] for u in usages)
    assert scrape.value("vllm:prefix_cache_queries_total", **labels) == sum(u["prompt_tokens"] for u in usages)
    assert 0 < scrape.value("vllm:prefix_cache_hits_total", **labels) < sum(u["prompt_tokens"] for u in usages)


def test_every_finished_request_is_one_observation_and_one_success(served: dict, model_name: str) -> None:
    scrape, reasons = served["scrape"], served["reasons"]
    finished = len(reasons)  # n = 2 is one engine request with two sequences (vLLM would count two)
    for name in REQUEST_HISTOGRAMS + ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                                      "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                                      "vllm:request_inference_time_seconds"):
        assert scrape.value(f"{name}_count", model_name=model_name) == finished, name
    several = sum(u["completion_tokens"] >= 2 for u in served["usages"])  # a TPOT needs a second token
    assert scrape.value("vllm:request_time_per_output_token_seconds_count", model_name=model_name) == several
    for reason in ("stop", "length", "abort"):
        assert scrape.value("vllm:request_success_total", model_name=model_name, finished_reason=reason) == \
            reasons.count(reason), reason
    # every request had several tokens: an interval between each two iterations that gave it some
    intervals = scrape.value("vllm:inter_token_latency_seconds_count", model_name=model_name)  # a count
    assert intervals > finished
    assert scrape.value("vllm:request_params_n_sum", model_name=model_name) == finished + 1


def test_at_rest_nothing_runs_or_waits_and_kv_usage_is_a_share(served: dict, model_name: str) -> None:
    scrape = served["scrape"]
    assert scrape.value("vllm:num_requests_running", model_name=model_name) == 0
    assert scrape.value("vllm:num_requests_waiting", model_name=model_name) == 0
    assert 0 <= scrape.value("vllm:kv_cache_usage_perc", model_name=model_name) <= 1
    assert scrape.value("kvscope_runs", kind="api") == 1
    assert scrape.value("kvscope_events_emitted_total", model_name=model_name) > 0


def test_the_dashboard_figures_are_the_scraped_ones(served: dict, model_name: str) -> None:
    """The run's record (what the dashboard builds from its snapshot) and /metrics read the same
    request_finished times and the same KV usage: sums and counts agree to the float."""
    record, scrape = RunRecord.from_snapshot(served["snapshot"]), served["scrape"]
    finishes = record.history.finishes
    assert record.state.serves_api and len(finishes) == len(served["reasons"])
    for attr, name in (("ttft_s", "vllm:time_to_first_token_seconds"),
                       ("tpot_s", "vllm:request_time_per_output_token_seconds"),
                       ("queue_s", "vllm:request_queue_time_seconds")):
        values = [getattr(f, attr) for f in finishes if getattr(f, attr) is not None]
        assert scrape.value(f"{name}_count", model_name=model_name) == len(values), name
        assert scrape.value(f"{name}_sum", model_name=model_name) == pytest.approx(sum(values), rel=1e-12), name
    e2e = [v.e2e_s for v in record.state.requests.values()]
    assert scrape.value("vllm:e2e_request_latency_seconds_sum", model_name=model_name) == pytest.approx(sum(e2e))
    last = record.state.metrics
    assert record.state.kv_usage == last["kv_usage"] == scrape.value("vllm:kv_cache_usage_perc", model_name=model_name)


def test_a_paused_request_is_running_and_holds_the_kv_the_dashboard_shows(url: str, model_name: str,
                                                                            served: dict) -> None:
    """Mid-request, with the API run paused, the gauges (the engine's counts) are the reducer's figures, not zero."""
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"model": model_name, "prompt": LONG_PROMPT, "max_tokens": 200, "temperature": 0,
                            "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):  # a first token: the request runs
            pass
        httpx.post(f"{url}/api/runs/api/control", json={"action": "pause"}, timeout=10).raise_for_status()
        try:
            snapshot, scrape = settled(url)
            record = RunRecord.from_snapshot(snapshot)
            assert scrape.value("vllm:num_requests_running", model_name=model_name) == len(record.state.running) == 1
            usage = scrape.value("vllm:kv_cache_usage_perc", model_name=model_name)
            assert usage == record.state.kv_usage == record.state.metrics["kv_usage"] > 0
        finally:
            httpx.post(f"{url}/api/runs/api/control", json={"action": "resume"}, timeout=10).raise_for_status()
        for _ in lines:
            pass


def test_off_loopback_metrics_need_the_token_unless_public_watch(model_name: str) -> None:
    for public_watch in (False, True):
        app = create_app(RunManager(default_model=model_name), token="s3cret", host="0.0.0.0",
                         public_watch=public_watch)
        with TestClient(app, base_url="http://my.server:8000") as c:
            assert c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
            assert c.get("/metrics").status_code == (200 if public_watch else 401)
    with TestClient(create_app(RunManager(default_model=model_name)), base_url="http://127.0.0.1:8000") as c:
        assert c.get("/metrics").status_code == 200  # on loopback, as every watching route


def test_speculative_counts_add_up_to_the_reducers(model_name: str) -> None:
    """The API runs do not speculate (api_run.api_engine): the same feed watches a speculative scenario
    run here, and its counts are the reducer's (accepted <= drafted, per position non-increasing)."""
    manager = RunManager(default_model=model_name)
    metrics = ServerMetrics(manager)
    run = manager.start_scenario("speculative-ngram", speed=0.0, paused=True)
    try:
        metrics.watch("demo", run)
        run.control("resume")
        deadline = time.monotonic() + 120
        while not run.finished:
            assert time.monotonic() < deadline, "the speculative run did not finish"
            time.sleep(0.05)
        scrape, spec = Scrape(metrics.exposition().decode()), run.state.spec
    finally:
        manager.stop_all()
    drafts = scrape.value("vllm:spec_decode_num_drafts_total", model_name="demo")
    drafted = scrape.value("vllm:spec_decode_num_draft_tokens_total", model_name="demo")
    accepted = scrape.value("vllm:spec_decode_num_accepted_tokens_total", model_name="demo")
    assert (drafts, drafted, accepted) == (spec.verifies, spec.proposed, spec.accepted)
    assert 0 < accepted <= drafted
    per_pos = [scrape.value("vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="demo", position=str(i))
               for i in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_counts_go_on_across_a_replaced_api_run_and_at_events_off(model_name: str) -> None:
    """A failed API run is replaced by a fresh one: the model's counters keep counting. With
    --api-events off the request counters and times still come (request_finished is kept)."""
    from kvscope.backend.server.limits import ServiceLimits

    manager = RunManager(default_model=model_name, limits=ServiceLimits(api_events="off"))
    body = {"model": model_name, "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    usages = []
    with TestClient(create_app(manager), base_url="http://127.0.0.1:8000", timeout=60) as c:
        usages.append(c.post("/v1/completions", json=body).json()["usage"])
        first = manager.api_run()
        first.fail("a test")
        usages.append(c.post("/v1/completions", json=body).json()["usage"])
        assert manager.api_run() is not first
        scrape = Scrape(c.get("/metrics").text)
    manager.stop_all()
    assert scrape.value("vllm:generation_tokens_total", model_name=model_name) == \
        sum(u["completion_tokens"] for u in usages) == 8
    assert scrape.value("vllm:prompt_tokens_total", model_name=model_name) == sum(u["prompt_tokens"] for u in usages)
    assert scrape.value("vllm:time_to_first_token_seconds_count", model_name=model_name) == 2
    assert scrape.value("vllm:request_success_total", model_name=model_name, finished_reason="length") == 2
    assert scrape.value("vllm:inter_token_latency_seconds_count", model_name=model_name) == 0  # no token events


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_at_events_off_admission_and_the_gauges_count_what_the_engine_runs(model_name: str) -> None:
    """--api-events off has no iteration events, so a reducer would count running requests as waiting
    forever. Three streams run and two requests wait (the run paused between two steps, so nothing
    moves): the gauges are the engine's counts, and the queue (--max-waiting 2) takes exactly two."""
    from kvscope.backend.server.limits import ServiceLimits
    from kvscope.backend.server.serve import serve_in_thread

    manager = RunManager(default_model=model_name, limits=ServiceLimits(api_events="off", max_waiting=2))
    long = {"model": model_name, "prompt": "ROMEO:", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started, leave = [threading.Event() for _ in range(3)], threading.Event()

    def stream(first_token: threading.Event) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as r:
            for line in r.iter_lines():  # leaving the block closes the connection: the server aborts it
                if line.startswith("data: {"):
                    first_token.set()
                if leave.is_set():
                    return

    def short() -> None:
        complete(url, {"model": model_name, "prompt": "JULIET:", "max_tokens": 2, "temperature": 0})

    with serve_in_thread(create_app(manager)) as url:
        engine = manager.api_run().engine
        streams = [threading.Thread(target=stream, args=(e,)) for e in started]
        waiting = [threading.Thread(target=short) for _ in range(2)]
        try:
            for t, first_token in zip(streams, started):  # one by one: each runs before the next arrives
                t.start()
                wait_for(first_token.is_set, "a stream's first token")
            httpx.post(f"{url}/api/runs/api/control", json={"action": "pause"}, timeout=10).raise_for_status()
            scrape = Scrape(httpx.get(f"{url}/metrics", timeout=10).text)
            assert scrape.value("vllm:num_requests_running", model_name=model_name) == engine.stats.num_running == 3
            assert scrape.value("vllm:num_requests_waiting", model_name=model_name) == engine.stats.num_waiting == 0
            for t in waiting:
                t.start()
            wait_for(lambda: engine.stats.num_waiting == 2, "two requests in the queue")
            full = httpx.post(f"{url}/v1/completions", timeout=10,
                              json={"model": model_name, "prompt": "HAMLET:", "max_tokens": 2})
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["type"] == "rate_limit_error"
            scrape = Scrape(httpx.get(f"{url}/metrics", timeout=10).text)
            assert scrape.value("vllm:num_requests_running", model_name=model_name) == 3
            assert scrape.value("vllm:num_requests_waiting", model_name=model_name) == 2
            usage = scrape.value("vllm:kv_cache_usage_perc", model_name=model_name)
            assert usage == engine.stats.kv_usage > 0
        finally:
            leave.set()
            httpx.post(f"{url}/api/runs/api/control", json={"action": "resume"}, timeout=10)
            for t in streams + waiting:
                if t.ident is not None:  # started
                    t.join(60)
    manager.stop_all()
