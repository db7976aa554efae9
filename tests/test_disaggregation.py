"""engine.disaggregation: prefill instances and decode instances, each prefilled request's KV blocks moving
from one to the other over a gloo group (docs/engine.md#disaggregated-prefill-and-decode).

The colocated engine is the reference: the same workload gives the same tokens, token for token, in every
sampling mode it supports, whatever the instance counts and the router, with decode instances short of
blocks (requests wait on their prefill instance, decode instances preempt and recompute). After every step
the events alone rebuild every instance's pool. The copies are real (the decode instance reads what the
link wrote: spoiling it changes the tokens) and measured; a failed transfer or a failed instance ends its
own requests only, naming what failed, and every block comes back.
"""

from __future__ import annotations

import math

import pytest

from kvscope.backend.config import DisaggregationConfig, EngineConfig
from kvscope.backend.engine.disaggregated import DisaggregatedEngine, build_engine
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.kv_link import KVLink, TransferFailed
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.schema import parse_event
from kvscope.backend.events.state import RunState
from kvscope.backend.model.loader import LoadedModel
from tests.engine_helpers import mixed_workload

MODES = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=0.8, top_p=0.9, top_k=40, seed=7),
    "unseeded": dict(temperature=1.0, min_p=0.05),  # the default seed: the request's arrival number
    "n=3": dict(temperature=0.9, n=3),
    "beams": dict(beam_width=3, n=2),
    "penalties": dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, seed=3),
    "logprobs+stop": dict(temperature=0.0, logprobs=5, stop=["the"]),
    "grammar": dict(temperature=0.6, structured_outputs={"regex": "(yes|no|maybe)( [a-z]+){2,5}"}),
}
SPLITS = {"1+1": DisaggregationConfig(), "2+1": DisaggregationConfig(prefill_instances=2),
          "1+2 least-loaded": DisaggregationConfig(decode_instances=2, router="least_loaded"),
          "2+3": DisaggregationConfig(prefill_instances=2, decode_instances=3)}
BASE = dict(block_size=8, num_blocks=96, max_num_seqs=6, max_num_batched_tokens=64)


def pools(engine: Engine | DisaggregatedEngine) -> list[tuple[int, Engine]]:
    """(first block in the events, engine) of each pool."""
    if isinstance(engine, Engine):
        return [(0, engine)]
    return [(i.first_block, i.engine) for i in engine.instances]


def check_pools(engine, state: RunState) -> None:
    """Each pool's bookkeeping holds, and the reducer, fed the events alone, has its tables and free queue."""
    for first, part in pools(engine):
        part.blocks.check_invariants(part.live_sequences())
        n = part.cache.num_blocks
        free = [b - first for b in state.free_blocks if first <= b < first + n]
        assert free == part.blocks.free_block_ids, f"pool at {first}: the reducer's free queue"
        for seq in part.live_sequences():
            table = [b + first for b in part.blocks.block_table(seq.seq_id)]
            assert state.block_tables.get(seq.seq_id, []) == table, f"seq {seq.seq_id}: the reducer's table"


def serve(loaded: LoadedModel, config: EngineConfig, workload, sampling: SamplingParams, events: list | None = None,
          max_steps: int = 3000):
    """Deliver the workload at its arrival steps and step to the end, checking every pool after every step."""
    bus, state = EventBus(level=config.events), RunState()
    bus.subscribe(state.apply)
    if events is not None:
        bus.subscribe(events.append)
    engine = build_engine(loaded, config, bus, seed=5)
    engine.emit_header()
    pending = sorted(workload, key=lambda w: w[1])
    try:
        while (pending or engine.has_unfinished()) and engine.step_no < max_steps:
            while pending and pending[0][1] <= engine.step_no:
                rid, _, prompt, max_tokens = pending.pop(0)
                engine.add_request(rid, prompt, max_tokens, sampling)
            engine.step()
            check_pools(engine, state)
    finally:
        engine.close()
    assert not pending and not engine.has_unfinished(), "the workload did not finish"
    return engine


def results(engine) -> dict[str, tuple]:
    """Each request's ending and every returned sequence's tokens, best first."""
    return {rid: (r.finish_reason, [o["output_token_ids"] for o in r.outputs]) for rid, r in engine.requests.items()}


@pytest.fixture(scope="module")
def work(demo: LoadedModel):
    return mixed_workload(demo, count=12, seed=4)


@pytest.mark.parametrize("mode", MODES)
def test_every_sampling_mode_gives_the_colocated_engines_tokens(demo, work, mode):
    sampling = SamplingParams(**MODES[mode])
    colocated = results(serve(demo, EngineConfig(**BASE), work, sampling))
    split = "2+3" if mode in ("greedy", "n=3") else "1+2 least-loaded" if mode == "beams" else "1+1"
    events: list[dict] = []
    engine = serve(demo, EngineConfig(**BASE, disaggregation=SPLITS[split]), work, sampling, events)
    assert results(engine) == colocated
    moved = {e["request_id"] for e in events if e["type"] == "kv_transfer"}
    one_token = {rid for rid, r in engine.requests.items() if max(len(o["output_token_ids"]) for o in r.outputs) <= 1}
    assert moved == set(engine.requests) - one_token, "every request with a decode moved, the others did not"


@pytest.mark.parametrize("split", SPLITS)
def test_every_split_and_router_gives_the_colocated_engines_tokens(demo, work, split):
    sampling = SamplingParams(**MODES["seeded"])
    colocated = results(serve(demo, EngineConfig(**BASE), work, sampling))
    events: list[dict] = []
    engine = serve(demo, EngineConfig(**BASE, disaggregation=SPLITS[split]), work, sampling, events)
    assert results(engine) == colocated
    roles = {i.index: i.role for i in engine.instances}
    for e in events:
        if e["type"] == "iteration":
            for row in e["batch"]:  # prefills on prefill instances, decodes on decode instances
                assert roles[row["instance"]] == ("decode" if row["phase"] == "decode" else "prefill"), row
    used = {row["instance"] for e in events if e["type"] == "iteration" for row in e["batch"]}
    assert used == set(roles), "the router gave every instance work"


def test_decode_instances_short_of_blocks_hold_requests_back_and_preempt_as_one_engine(demo, work):
    """16 blocks a decode instance: prefilled requests wait on the prefill instance for room, and the decode
    instance preempts and recomputes; the tokens are still the colocated engine's."""
    sampling = SamplingParams(**MODES["greedy"])
    colocated = results(serve(demo, EngineConfig(**BASE), work, sampling))
    config = EngineConfig(**{**BASE, "num_blocks": 16}, disaggregation=DisaggregationConfig())
    events: list[dict] = []
    engine = serve(demo, config, work, sampling, events)
    assert results(engine) == colocated
    decode_rows = [(e["step"], row) for e in events if e["type"] == "iteration" for row in e["batch"]
                   if row["instance"] == 1]
    assert any(e["type"] == "preempt" for e in events), "a decode instance preempted"
    assert any(row["phase"] == "prefill" for _, row in decode_rows), "the decode instance recomputed what it preempted"
    first_token = {e["request_id"]: e["step"] for e in reversed(events) if e["type"] == "token"}
    moved_at = {e["request_id"]: e["step"] for e in events if e["type"] == "kv_transfer"}
    assert any(moved_at[rid] > first_token[rid] for rid in moved_at), "a request waited for room"


def test_the_decode_instance_reads_the_blocks_the_link_wrote(demo, work, monkeypatch):
    """Spoil what arrives and the tokens change: the decode instance computes from the moved KV, not its own."""
    sampling = SamplingParams(**MODES["greedy"])
    config = EngineConfig(**BASE, disaggregation=DisaggregationConfig())
    honest = results(serve(demo, config, work, sampling))
    copy = KVLink.send_blocks

    def spoiled(self, src, dst, src_cache, dst_cache, src_blocks, dst_blocks):
        sent = copy(self, src, dst, src_cache, dst_cache, src_blocks, dst_blocks)
        dst_cache.data[:, :, dst_blocks] *= -1
        return sent

    monkeypatch.setattr(KVLink, "send_blocks", spoiled)
    assert results(serve(demo, config, work, sampling)) != honest


def test_each_transfer_is_measured_and_part_of_its_requests_ttft(demo, work):
    config = EngineConfig(**BASE, disaggregation=DisaggregationConfig())
    events: list[dict] = []
    engine = serve(demo, config, work, SamplingParams(temperature=0.0), events)
    for e in events:
        parse_event(e)
    header = events[0]
    assert header["cache"]["num_blocks"] == 2 * BASE["num_blocks"]
    assert [(i["role"], i["first_block"]) for i in header["disaggregation"]["instances"]] == \
        [("prefill", 0), ("decode", BASE["num_blocks"])]
    per_block = header["cache"]["bytes_per_block"]
    finished = {e["request_id"]: e for e in events if e["type"] == "request_finished"}
    for t in (e for e in events if e["type"] == "kv_transfer"):
        n = len(t["src_blocks"])
        prompt = len(engine.requests[t["request_id"]].prompt_ids)
        assert n == len(t["dst_blocks"]) == math.ceil(prompt / BASE["block_size"])  # the prompt's KV, no more
        assert all(b < BASE["num_blocks"] <= d for b, d in zip(t["src_blocks"], t["dst_blocks"]))
        assert t["bytes"] == n * per_block + 2 * n * 8  # the contents and the [2, n] int64 table
        assert t["link_s"] > 0
        done = finished[t["request_id"]]
        assert done["transfer_s"] == t["link_s"]
        assert done["ttft_s"] >= done["queue_s"] + done["transfer_s"]


def test_a_failed_transfer_ends_its_own_request_alone(demo, work, monkeypatch):
    sampling = SamplingParams(temperature=0.0)
    colocated = results(serve(demo, EngineConfig(**BASE), work, sampling))
    copy = KVLink.send_blocks
    victim = "r3"

    def failing(self, src, dst, src_cache, dst_cache, src_blocks, dst_blocks):
        if failing.next_is_victim:
            raise TransferFailed("connection reset by peer")
        return copy(self, src, dst, src_cache, dst_cache, src_blocks, dst_blocks)

    real_move = DisaggregatedEngine._move

    def move(self, src, dst, request_id):
        failing.next_is_victim = request_id == victim
        return real_move(self, src, dst, request_id)

    monkeypatch.setattr(KVLink, "send_blocks", failing)
    monkeypatch.setattr(DisaggregatedEngine, "_move", move)
    events: list[dict] = []
    engine = serve(demo, EngineConfig(**BASE, disaggregation=DisaggregationConfig()), work, sampling, events)
    got = results(engine)
    assert got.pop(victim)[0] == "abort"
    assert got == {rid: r for rid, r in colocated.items() if rid != victim}
    reason = next(e["reason"] for e in events if e["type"] == "request_finished" and e["request_id"] == victim)
    assert "from instance 0 to instance 1 failed" in reason and "connection reset" in reason
    assert all(i.engine.blocks.num_free_blocks == i.engine.cache.num_blocks for i in engine.instances)


def test_a_failed_instance_ends_its_own_requests_and_is_given_no_more(demo, work, monkeypatch):
    """Decode instance 2 fails at step 6: the requests it held end aborted naming it, those after go to
    instance 1, and every other request gets the colocated engine's tokens."""
    sampling = SamplingParams(temperature=0.0)
    colocated = results(serve(demo, EngineConfig(**BASE), work, sampling))
    config = EngineConfig(**BASE, disaggregation=DisaggregationConfig(decode_instances=2))
    real = Engine.plan_and_execute

    def breaking(self):
        if self.scheduler.role == "decode" and self.events.block_offset == 2 * BASE["num_blocks"] and self.step_no == 6:
            raise RuntimeError("device lost")
        return real(self)

    monkeypatch.setattr(Engine, "plan_and_execute", breaking)
    events: list[dict] = []
    engine = serve(demo, config, work, sampling, events)
    got = results(engine)
    aborted = {rid for rid, (reason, _) in got.items() if reason == "abort"}
    assert aborted, "instance 2 held requests when it failed"
    reasons = {e["reason"] for e in events if e["type"] == "request_finished" and e["request_id"] in aborted}
    assert reasons == {"decode instance 2 failed: RuntimeError: device lost"}
    assert {rid: r for rid, r in got.items() if rid not in aborted} == \
        {rid: r for rid, r in colocated.items() if rid not in aborted}
    later = [e["dst_instance"] for e in events if e["type"] == "kv_transfer" and e["step"] > 6]
    assert later and set(later) == {1}


def test_with_no_prefill_instance_left_a_request_is_refused_naming_the_field(demo):
    engine = build_engine(demo, EngineConfig(**BASE, disaggregation=DisaggregationConfig()), seed=0)
    try:
        engine.prefill[0].alive = False
        with pytest.raises(RequestError) as e:
            engine.add_request("late", "hello there", 4)
        assert e.value.field == "engine.disaggregation"
    finally:
        engine.close()


@pytest.mark.parametrize("field, settings", [
    ("engine.speculative", {"speculative": {"method": "ngram"}}),
    ("engine.kv_cache", {"kv_cache": False}),
    ("engine.kv_layout", {"kv_layout": "contiguous"}),
    ("engine.compile_decode", {"compile_decode": True}),
    ("engine.tensor_parallel", {"tensor_parallel": 2}),
])
def test_what_it_does_not_run_with_is_refused_naming_the_field(demo, field, settings):
    with pytest.raises(RequestError) as e:
        build_engine(demo, EngineConfig(**BASE, **settings, disaggregation=DisaggregationConfig()))
    assert e.value.field == field


def test_more_blocks_in_all_than_a_trace_may_number_are_refused_before_any_pool_is_made(demo):
    with pytest.raises(RequestError) as e:
        build_engine(demo, EngineConfig(num_blocks=400_000, disaggregation=DisaggregationConfig(decode_instances=2)))
    assert e.value.field == "engine.num_blocks" and "3 instances of 400,000 blocks" in e.value.reason


def test_a_server_counts_every_instances_pool_against_its_kv_limits(demo):
    from kvscope.backend.server.limits import kv_cache_bytes

    one = kv_cache_bytes(EngineConfig(**BASE), demo.config)
    split = EngineConfig(**BASE, disaggregation=DisaggregationConfig(prefill_instances=2, decode_instances=3))
    assert kv_cache_bytes(split, demo.config) == 5 * one
    engine = build_engine(demo, split)
    try:
        assert sum(i.engine.cache.data.numel() * i.engine.cache.data.element_size() for i in engine.instances) \
            == 5 * one
    finally:
        engine.close()


def test_the_same_run_gives_the_same_events(demo, work):
    config = EngineConfig(**BASE, disaggregation=DisaggregationConfig(prefill_instances=2, decode_instances=2,
                                                                        router="least_loaded"))
    timed = {"t", "duration_s", "execute_s", "link_s", "ttft_s", "tpot_s", "e2e_s", "queue_s", "transfer_s",
             "tokens_per_s", "run_id"}

    def untimed(events):
        out = []
        for e in events:
            e = {k: v for k, v in e.items() if k not in timed}
            if "instances" in e:
                e["instances"] = [{k: v for k, v in i.items() if k not in timed} for i in e["instances"]]
            out.append(e)
        return out

    runs = []
    for _ in range(2):
        events: list[dict] = []
        serve(demo, config, work, SamplingParams(**MODES["unseeded"]), events)
        runs.append(untimed(events))
    assert runs[0] == runs[1]
