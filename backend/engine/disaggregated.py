"""Disaggregated prefill and decode: prefill instances run prompts, decode instances run decodes, and
each prefilled request's KV blocks move from one to the other over torch.distributed (DistServe,
Splitwise, Mooncake; vLLM's and SGLang's prefill/decode disaggregation).

Each instance is an Engine of its own: its KV cache (engine.num_blocks of its own), its scheduler (the
engine's, told its role), its executor and its clock. They share the weights, one event bus and one
numbering of sequences. One `step()` steps every live instance once, in order:

    each instance: schedule and execute     its block changes go out as events
    one iteration event                     every instance's rows, each instance timed on its own clock
    each instance: update                   tokens, forks, ends
    handoffs                                a prefilled request moves: a decode instance (the router's
                                            pick) takes blocks, the link copies the KV into them, the
                                            prefill instance frees its own
    one metrics event                       over every pool

The instances run in this one process, one after the other. Each keeps its own clock, the seconds it
has spent stepping, as a machine of its own would count them, and the run's time advances by its
slowest instance's step. A request's times move onto its decode instance's clock as it arrives there
(Scheduler.arrived): its TTFT is its queue and prefill on the prefill instance plus the link's time,
its TPOT the decode instance's steps alone. Lockstep keeps a run deterministic: the same scenario and
seed give the same events.

What moves where: the request itself (its sequences, sampling streams, grammar positions and texts) is
handed over in this process; its blocks' contents and their table go over the link (kv_link.py). An
instance whose step fails ends its own requests (aborted, naming it) and is given no more; a transfer
that fails ends its request alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvscope.backend.config import MAX_NUM_BLOCKS, EngineConfig
from kvscope.backend.engine.dist_rows import DistRows
from kvscope.backend.engine.engine import Engine, EngineStats, Runtime, StepTimes, load_runtime
from kvscope.backend.engine.kv_link import KVLink, TransferFailed
from kvscope.backend.engine.metrics import MetricsTracker, kv_snapshot
from kvscope.backend.engine.request import Request, RequestError
from kvscope.backend.engine.request_output import Sink
from kvscope.backend.engine.router import Router
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.scheduler import Numbering, Role
from kvscope.backend.engine.scheduler_output import SchedulerOutput
from kvscope.backend.engine.step_output import StepOutput
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.loader import LoadedModel
from kvscope.backend.model.weights import WeightCache

log = logging.getLogger(__name__)
REASON_CHARS = 300  # what an aborted request's reason repeats of an instance's failure


def check_disaggregation(config: EngineConfig) -> None:
    """What disaggregation runs with; the rest is refused naming the field, never ignored."""
    refusals = (
        (config.speculative is not None, "engine.speculative", "a draft model's cache would have to move too"),
        (config.tensor_parallel > 1, "engine.tensor_parallel", "each instance runs on one rank"),
        (not config.kv_cache, "engine.kv_cache", "what moves is the KV cache: it needs kv_cache: true"),
        (config.kv_layout != "paged", "engine.kv_layout", "blocks move between paged pools: kv_layout paged"),
        (config.compile_decode, "engine.compile_decode", "each instance would compile its own graph"),
    )
    for refused, field, why in refusals:
        if refused:
            raise RequestError(field, f"not with engine.disaggregation: {why}")


def check_blocks(num_blocks: int | None, instances: int) -> None:
    """The instances' pools are numbered as one in the events: together at most MAX_NUM_BLOCKS."""
    if num_blocks is not None and num_blocks * instances > MAX_NUM_BLOCKS:
        raise RequestError("engine.num_blocks", f"{instances} instances of {num_blocks:,} blocks each are more than "
                                                f"{MAX_NUM_BLOCKS:,} blocks in all: fewer blocks, or fewer instances")


class InstanceClock:
    """An instance's own clock: the seconds it has spent stepping."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since: float | None = None

    def __call__(self) -> float:
        return self.seconds + (time.perf_counter() - self._since if self._since is not None else 0.0)

    @contextmanager
    def running(self) -> Iterator[None]:
        self._since = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - self._since
            self._since = None


@dataclass(eq=False)
class Instance:
    index: int
    role: Role
    engine: Engine
    clock: InstanceClock
    first_block: int  # its block 0 in the events
    alive: bool = True

    def load(self) -> tuple[int, int]:
        """The router's least-loaded key: sequences held, then fewer free blocks."""
        return len(self.engine.scheduler.live), -self.engine.blocks.num_free_blocks


@dataclass(frozen=True)
class Ran:
    """One instance's stages of a step, before its results become state."""

    instance: Instance
    plan: SchedulerOutput
    out: StepOutput
    times: StepTimes


class DisaggregatedEngine:
    """Prefill instances, decode instances, a router, and the link between them; outwardly one engine."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, bus: EventBus | None = None, seed: int = 0,
                 shared: WeightCache | None = None) -> None:
        check_disaggregation(config)
        d = config.disaggregation
        self.loaded, self.config, self.seed = loaded, config, seed
        self.bus = bus or EventBus(level=config.events)
        numbering = Numbering()
        self.instances: list[Instance] = []
        first_block = 0
        roles = ["prefill"] * d.prefill_instances + ["decode"] * d.decode_instances
        self.link: KVLink | None = None
        check_blocks(config.num_blocks, len(roles))  # before any pool is allocated, when the config says
        for index, role in enumerate(roles):
            clock = InstanceClock()
            runtime = load_runtime(loaded, config, shared)
            runtime.clock = clock
            engine = Engine(loaded, config, self.bus, seed, runtime=runtime, shared=shared, role=role,
                            numbering=numbering, block_offset=first_block)
            self.instances.append(Instance(index, role, engine, clock, first_block))
            first_block += engine.cache.num_blocks
            try:  # a pool sized from kv_cache_memory_mb: known once the first is built
                check_blocks(engine.cache.num_blocks, len(roles))
            except RequestError:
                self.close()
                raise
        self.num_blocks = first_block
        self.prefill = [i for i in self.instances if i.role == "prefill"]
        self.decode = [i for i in self.instances if i.role == "decode"]
        self.link = KVLink(len(self.instances), [(p.index, q.index) for p in self.prefill for q in self.decode],
                           config.tensor_parallel_timeout_s)
        self.router = Router(d.router)
        self.metrics = MetricsTracker()
        self.elapsed = 0.0  # the run's seconds: each step as long as its slowest instance's
        self.step_no = 0
        self.stats = EngineStats(num_blocks=self.num_blocks)
        first = self.instances[0].engine  # what a caller reads of one engine: the same on each instance
        self.runtime, self.grammars = first.runtime, first.grammars

    def clock(self) -> float:
        return self.elapsed

    # ---- one iteration ------------------------------------------------------------------------------

    def step(self) -> None:
        self.bus.step = self.step_no
        ran: list[Ran] = []
        for instance in self._alive(self.instances):
            instance.engine.step_no = self.step_no
            try:
                with instance.clock.running():
                    ran.append(Ran(instance, *instance.engine.plan_and_execute()))
            except Exception as e:  # noqa: BLE001 - an instance that fails ends its own requests, not the run
                self._fail(instance, e)
        self.instances[0].engine.events.instances_iteration(
            [(r.instance.index, r.plan, r.times.duration_s, r.times.execute_s) for r in ran])
        appended = 0
        for r in ran:
            try:
                with r.instance.clock.running():
                    appended += r.instance.engine.update(r.plan, r.out, r.times.ended)
            except Exception as e:  # noqa: BLE001 - as above
                self._fail(r.instance, e)
        self._hand_off()
        self.elapsed += max((r.times.duration_s for r in ran), default=0.0)
        self.metrics.on_iteration(self.elapsed, sum(r.plan.num_prefill_tokens for r in ran), appended)
        self._metrics_event()
        self.step_no += 1
        self._count()

    def _hand_off(self) -> None:
        """Every prefilled request to a decode instance that has room for its blocks; one that has none
        waits where it is, holding its blocks, and tries again after the next step."""
        for src in self._alive(self.prefill):
            for request_id in src.engine.scheduler.prefilled_requests():
                dst = self.router.pick("decode", self.decode)
                if dst is None:
                    src.engine.abort(request_id, "no decode instance is running")
                    continue
                if not self._move(src, dst, request_id):
                    break  # the router names the same full instance for the rest: they wait too

    def _move(self, src: Instance, dst: Instance, request_id: str) -> bool:
        """Move one request's blocks from src to dst; False if dst has too few free blocks."""
        moving = src.engine.scheduler.moving(request_id)
        here = dst.engine.adopt(moving)
        if here is None:
            return False
        self.router.picked("decode")
        src_blocks = list(here)  # [its blocks in src's pool]
        dst_blocks = [here[b] for b in src_blocks]  # [the blocks dst gave them, in the same order]
        try:
            sent = self.link.send_blocks(src.index, dst.index, src.engine.cache, dst.engine.cache, src_blocks,
                                         dst_blocks)
        except TransferFailed as e:
            src.engine.release(moving)
            dst.engine.abort(request_id, f"moving its KV blocks from instance {src.index} to instance {dst.index} "
                                         f"failed: {e}"[:REASON_CHARS])
            return True
        dst.engine.scheduler.arrived(moving, sent.seconds)
        src.engine.events.kv_transfer(request_id, [s.seq_id for s in moving.seqs], src.index, dst.index,
                                      [b + src.first_block for b in src_blocks],
                                      [b + dst.first_block for b in dst_blocks], sent.bytes, sent.seconds)
        src.engine.release(moving)
        return True

    def _fail(self, instance: Instance, error: Exception) -> None:
        """An instance whose step raised: its requests end, aborted naming it, and it is given no more."""
        instance.alive = False
        why = f"{instance.role} instance {instance.index} failed: {type(error).__name__}: {error}"[:REASON_CHARS]
        log.error("disaggregated run: %s", why)
        instance.engine.abort_all(why)

    def _metrics_event(self) -> None:
        pools = [(i.engine.live_sequences(), i.engine.blocks) for i in self.instances]
        kv = self.metrics.observe(kv_snapshot(pools))
        self.instances[0].engine.events.metrics(
            self.metrics.tokens_per_s(), kv, self.prefix_hit_rate, self.num_preemptions,
            sum(len(i.engine.scheduler.running) for i in self.instances),
            sum(len(i.engine.scheduler.waiting) for i in self.instances), {})

    def _count(self) -> None:
        stats = [i.engine.stats for i in self.instances]
        self.stats = EngineStats(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                                 sum(s.num_blocks_used for s in stats), self.num_blocks,
                                 sum(s.num_preemptions for s in stats))

    @staticmethod
    def _alive(instances: list[Instance]) -> list[Instance]:
        return [i for i in instances if i.alive]

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], max_tokens: int,
                    sampling: SamplingParams | dict | None = None, arrival: float | None = None,
                    grammar=None) -> Request:
        """Queue a request on the prefill instance the router picks (Engine.add_request's refusals)."""
        target = self.router.pick("prefill", self.prefill)
        refusal = (RequestError("id", f"duplicate request id {request_id!r}") if request_id in self.requests else
                   RequestError("engine.disaggregation", "no prefill instance is running") if target is None else None)
        if refusal is not None:
            self.bus.emit("request_rejected", request_id=request_id, field=refusal.field, reason=refusal.reason)
            raise refusal
        target.engine.step_no = self.step_no
        if arrival is not None:  # read from self.clock: as long ago on the instance's own clock
            arrival = target.clock() - (self.elapsed - arrival)
        request = target.engine.add_request(request_id, prompt, max_tokens, sampling, arrival, grammar)
        self.router.picked("prefill")
        self._count()
        return request

    def _holder(self, request_id: str) -> Engine | None:
        return next((i.engine for i in self.instances if request_id in i.engine.requests), None)

    def abort(self, request_id: str, reason: str = "aborted by the user") -> None:
        holder = self._holder(request_id)
        if holder is not None:
            holder.abort(request_id, reason)
            self._count()

    def abort_all(self, reason: str) -> None:
        for instance in self.instances:
            instance.engine.abort_all(reason)
        self._count()

    def forget(self, request_id: str) -> None:
        holder = self._holder(request_id)
        if holder is not None:
            holder.forget(request_id)

    def keep_rows(self, rows: DistRows) -> None:
        for instance in self.instances:
            instance.engine.keep_rows(rows)

    def stream_outputs(self, sink: Sink) -> None:
        for instance in self.instances:
            instance.engine.stream_outputs(sink)

    def has_unfinished(self) -> bool:
        return any(i.engine.has_unfinished() for i in self.instances)

    @property
    def requests(self) -> dict[str, Request]:
        """Every instance's requests: each is held by one instance at a time."""
        return {rid: r for i in self.instances for rid, r in i.engine.requests.items()}

    @property
    def num_preemptions(self) -> int:
        return sum(i.engine.num_preemptions for i in self.instances)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found cached over those looked up, on every instance together."""
        counts = [i.engine.blocks.prefix_counts for i in self.instances]
        looked = sum(n for _, n in counts)
        return sum(h for h, _ in counts) / looked if looked else 0.0

    def close(self) -> None:
        for instance in self.instances:
            instance.engine.close()
        if self.link is not None:
            self.link.close()

    # ---- the header ---------------------------------------------------------------------------------

    def emit_header(self, scenario: dict | None = None, model_name: str | None = None) -> None:
        d = self.config.disaggregation
        self.instances[0].engine.emit_header(scenario, model_name, num_blocks=self.num_blocks, disaggregation={
            "prefill_instances": d.prefill_instances, "decode_instances": d.decode_instances, "router": d.router,
            "link": f"{self.link.backend} ({self.link.host})",
            "instances": [{"instance": i.index, "role": i.role, "first_block": i.first_block,
                           "num_blocks": i.engine.cache.num_blocks} for i in self.instances]})


def build_engine(loaded: LoadedModel, config: EngineConfig, bus: EventBus | None = None, seed: int = 0,
                 runtime: Runtime | None = None, shared: WeightCache | None = None) -> Engine | DisaggregatedEngine:
    """The engine a config asks for: one, or disaggregated instances (which run real weights only)."""
    if config.disaggregation is None:
        return Engine(loaded, config, bus, seed=seed, runtime=runtime, shared=shared)
    if runtime is not None:
        raise RequestError("engine.disaggregation", "runs real weights: not in simulate mode")
    return DisaggregatedEngine(loaded, config, bus, seed, shared)
