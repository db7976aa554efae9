"""GET /metrics: the API runs' numbers in Prometheus' text format, under vLLM's (v1) names and buckets.

What a Prometheus scrape asks for already exists as events: each request_finished carries the engine's
own times (backend/engine/metrics.py RequestTimes: TTFT, TPOT, end to end, queue), each metrics event
the KV usage, and the reducer (RunState) holds the queues. So this module reads the same events the
dashboard reads, on the server's side, and the engine knows nothing of HTTP or Prometheus:

- counters and histograms are observed from the events of every API run ("api", "api-NAME": one
  per model), as a subscriber of its bus. They live in the app's own registry, by model, so a run the
  manager replaces (a failed one) keeps counting where the last one stopped;
- gauges (running, waiting, KV usage) are read from each run's engine when scraped (`Engine.stats`,
  its own count, replaced after every step, add and abort), never from its reducer: at --api-events
  off no iteration event says what runs. With events on, the reducer holds the same figures at the end
  of each iteration, so the dashboard's queues and KV usage are the scraped ones. Viewers are the run's.

A registry per app, not prometheus_client's global one: tests make many apps in one process.
At --api-events off there are no token, iteration, preempt or spec_verify events: the metrics built
from those (inter-token latency, iteration tokens, speculative decoding) stay at zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvscope.backend.config import EngineConfig
from kvscope.backend.server.api_run import ApiRun
from kvscope.backend.server.engine_run import EngineRun
from kvscope.backend.server.generation import FINISH_REASONS
from kvscope.backend.server.manager import RunManager

# No `*_created` series beside each counter and histogram (they double the scrape and no dashboard reads
# them); process-wide in prometheus_client, and kvscope's server is its only user in the process.
disable_created_metrics()

Event = dict[str, Any]
LABELS = ["model_name", "engine"]  # vLLM's; one engine per model here, "0"
ENGINE = "0"
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's finished_reason values that kvscope has

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_TIME_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class ServerMetrics:
    """The app's registry: counters and histograms fed by the API runs' events, gauges read at scrape time."""

    def __init__(self, manager: RunManager) -> None:
        self.manager = manager
        self.registry = CollectorRegistry(auto_describe=True)
        self._declare(self.registry, build_1_2_5_buckets(EngineConfig().max_model_len))  # the API runs' engines
        self.registry.register(LiveGauges(manager))
        manager.watch_api_runs(self.watch)

    def _declare(self, r: CollectorRegistry, token_buckets: list[int]) -> None:
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*LABELS, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.success = counter("vllm:request_success", "Count of successfully processed requests.",
                               ("finished_reason",))
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", ("position",))
        self.events = counter("kvscope_events_emitted", "Events the model's API runs emitted (at --api-events).")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_TIME_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", TOKEN_TIME_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.output_len = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                    token_buckets)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    token_buckets)
        self.n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS)

    def watch(self, model: str, run: EngineRun) -> None:
        """Count this API run's events under its model (every series starts at 0, as Prometheus likes)."""
        spec = run.engine.config.speculative
        counter = RunEventCounter(self, model, spec.num_tokens if spec else 0)
        run.bus.subscribe(counter.apply)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RunEventCounter:
    """Counts one API run's events into the app's counters and histograms, under its model's labels (a
    subscriber of the run's bus: on its worker thread, after its reducer saw each event)."""

    def __init__(self, metrics: ServerMetrics, model: str, num_spec_tokens: int) -> None:
        self.m, self.labels = metrics, (model, ENGINE)
        self.prompt_len: dict[str, int] = {}  # request -> its prompt's tokens, until it finishes
        self.last_token: dict[str, tuple[int, float]] = {}  # request -> (step, t) of its newest tokens
        self.preemptions = 0  # the engine's count so far (metrics events carry a running total)
        self._start_series(num_spec_tokens)
        # the series every event, token or iteration touches, looked up once (labels() takes a lock)
        self.events, self.itl = metrics.events.labels(*self.labels), metrics.itl.labels(*self.labels)
        self.iteration_tokens = metrics.iteration_tokens.labels(*self.labels)
        self._handlers = {"request_arrived": self._arrived, "request_rejected": self._rejected,
                          "request_finished": self._finished, "token": self._token, "metrics": self._metrics,
                          "iteration": self._iteration, "spec_verify": self._verified}

    def _start_series(self, num_spec_tokens: int) -> None:
        m = self.m
        for metric in (m.preemptions, m.prompt_tokens, m.generation_tokens, m.prefix_queries, m.prefix_hits,
                       m.events, m.ttft, m.itl, m.tpot, m.e2e, m.queue, m.prefill, m.decode, m.inference,
                       m.prompt_len, m.output_len, m.max_tokens, m.n, m.iteration_tokens):
            metric.labels(*self.labels)
        for reason in FINISHED_REASONS:
            m.success.labels(*self.labels, reason)
        if num_spec_tokens:  # as vLLM: speculative series only where a run speculates
            for metric in (m.drafts, m.draft_tokens, m.accepted):
                metric.labels(*self.labels)
            for pos in range(num_spec_tokens):
                m.accepted_per_pos.labels(*self.labels, str(pos))

    def apply(self, event: Event) -> None:
        self.events.inc()
        handler = self._handlers.get(event["type"])
        if handler is not None:
            handler(event)

    def _arrived(self, e: Event) -> None:
        self.prompt_len[e["request_id"]] = len(e["prompt_token_ids"])
        n = e["sampling"].get("n", 1)
        self.m.n.labels(*self.labels).observe(n if isinstance(n, int) else 1)
        self.m.max_tokens.labels(*self.labels).observe(e["max_tokens"])

    def _rejected(self, e: Event) -> None:
        self.prompt_len.pop(e["request_id"], None)

    def _finished(self, e: Event) -> None:
        m, labels = self.m, self.labels
        prompt = self.prompt_len.pop(e["request_id"], 0)
        self.last_token.pop(e["request_id"], None)
        generated = sum(len(o["output_token_ids"]) for o in e.get("outputs") or [e])  # every returned sequence
        m.prompt_tokens.labels(*labels).inc(prompt)
        m.generation_tokens.labels(*labels).inc(generated)
        m.prefix_queries.labels(*labels).inc(prompt)
        m.prefix_hits.labels(*labels).inc(e.get("num_cached_prompt_tokens") or 0)
        m.prompt_len.labels(*labels).observe(prompt)
        m.output_len.labels(*labels).observe(generated)
        m.success.labels(*labels, FINISH_REASONS.get(e["finish_reason"], e["finish_reason"])).inc()
        self._times(e)

    def _times(self, e: Event) -> None:
        """The engine's RequestTimes, exactly as the event carries them (and the dashboard shows them)."""
        m, labels = self.m, self.labels
        ttft, tpot, e2e, queue = e["ttft_s"], e["tpot_s"], e["e2e_s"], e.get("queue_s")
        m.e2e.labels(*labels).observe(e2e)
        if ttft is not None:
            m.ttft.labels(*labels).observe(ttft)
            m.decode.labels(*labels).observe(e2e - ttft)
        if tpot is not None:
            m.tpot.labels(*labels).observe(tpot)
        if queue is not None:
            m.queue.labels(*labels).observe(queue)
            m.inference.labels(*labels).observe(e2e - queue)
            if ttft is not None:
                m.prefill.labels(*labels).observe(ttft - queue)

    def _token(self, e: Event) -> None:
        """Inter-token latency: per request, between the iterations that gave it tokens (as vLLM, one
        interval per iteration, however many tokens or sequences it appended)."""
        rid, step = e["request_id"], e["step"]
        last = self.last_token.get(rid)
        if last is not None and last[0] == step:
            return
        if last is not None:
            self.itl.observe(e["t"] - last[1])
        self.last_token[rid] = (step, e["t"])

    def _metrics(self, e: Event) -> None:
        grown = e["num_preemptions"] - self.preemptions
        if grown > 0:
            self.m.preemptions.labels(*self.labels).inc(grown)
        self.preemptions = e["num_preemptions"]

    def _iteration(self, e: Event) -> None:
        if e["num_batched_tokens"]:
            self.iteration_tokens.observe(e["num_batched_tokens"])

    def _verified(self, e: Event) -> None:
        m, labels = self.m, self.labels
        m.drafts.labels(*labels).inc()
        m.draft_tokens.labels(*labels).inc(len(e["results"]))
        m.accepted.labels(*labels).inc(e["num_accepted"])
        for pos in range(e["num_accepted"]):
            m.accepted_per_pos.labels(*labels, str(pos)).inc()


class LiveGauges(Collector):
    """What holds now, read from each API run's engine counts when Prometheus scrapes."""

    def __init__(self, manager: RunManager) -> None:
        self.manager = manager

    def describe(self) -> list[Metric]:
        return []  # families come and go with the runs; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=LABELS)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=LABELS)
        viewers = GaugeMetricFamily("kvscope_dashboard_viewers", "Websocket viewers (dashboards) of the model's "
                                                                 "API run.", labels=LABELS)
        runs = GaugeMetricFamily("kvscope_runs", "Runs the server holds, by kind (api, scenario, replay).",
                                 labels=["kind"])
        by_kind: dict[str, int] = {}
        for run in self.manager.list():
            by_kind[run.kind] = by_kind.get(run.kind, 0) + 1
            if not isinstance(run, ApiRun):
                continue
            labels, stats = [run.model, ENGINE], run.engine.stats
            running.add_metric(labels, stats.num_running)
            waiting.add_metric(labels, stats.num_waiting)
            usage.add_metric(labels, stats.kv_usage)
            with run.lock:
                viewers.add_metric(labels, len(run.viewers.watchers))
        for kind, count in sorted(by_kind.items()):
            runs.add_metric([kind], count)
        yield from (running, waiting, usage, viewers, runs)
