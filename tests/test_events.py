"""The event stream: schema, bus levels, JSONL traces and the RunState reducer."""

from __future__ import annotations

import itertools
import json

import pytest
from pydantic import ValidationError

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.pacing import Pacing
from kvscope.backend.events.schema import EVENT_TYPES, SCHEMA_VERSION, describe_error, json_schema, parse_event
from kvscope.backend.events.state import PLAIN_FIELDS, RunState
from kvscope.backend.events.trace import TraceError, TraceWriter, read_trace, strip_times

MODEL = {
    "name": "demo",
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 16,
    "attention": "gqa",
    "vocab_size": 96,
    "dtype": "float32",
    "kv_bytes_per_token": 512,
    "eos_token_ids": [0],
    "config": {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2},
}


def header_fields(num_blocks: int = 6, block_size: int = 4) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": "run-1",
        "scenario": {"name": "tiny"},
        "config": {"block_size": block_size, "num_blocks": num_blocks},
        "model": MODEL,
        "cache": {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "bytes_per_block": 512 * block_size,
            "dtype": "float32",
            "formula": {"kv_bytes_per_token": "2 * n_layers * n_kv_heads * head_dim * 4"},
        },
        "weights": {"quant": "int4", "group_size": 64, "bytes": 1024, "bytes_unquantized": 4096},
        "attention_backend": "torch",
        "device": "cpu",
        "draft_model": {"name": "demo-draft", "n_layers": 1, "kv_bytes_per_token": 128, "bytes_per_block": 512},
        "simulated": {"model_shape": "llama-3-8b", "hardware": "h100", "hardware_label": "NVIDIA H100", "tp": 1,
                      "link": None, "gpu_memory_utilization": 0.9, "weights_bytes_per_gpu": 16e9,
                      "kv_pool_bytes_per_gpu": 56e9, "kv_bytes_per_token_per_gpu": 131072.0, "peak_flops": 989e12,
                      "mem_bandwidth": 3.35e12, "ridge": 295.2, "stand_in_vocab": 2048},
        "tensor_parallel": {"size": 2, "backend": "gloo", "launcher": "spawn", "timeout_s": 60.0,
                            "embedding": "replicated", "lm_head": "rank 0", "kv_heads_replicated": False,
                            "ranks": [{"rank": r, "heads": [4 * r, 4 * r + 4], "kv_heads": [r, r + 1],
                                       "intermediate": [384 * r, 384 * r + 384], "weight_bytes": 1000,
                                       "kv_bytes_per_token": 256, "kv_bytes": 256 * block_size * num_blocks,
                                       "host": f"box ({'127.0.0.1' if r == 0 else '10.0.0.2'})"}
                                      for r in range(2)]},
        "disaggregation": {"prefill_instances": 1, "decode_instances": 1, "router": "round_robin",
                           "link": "gloo (127.0.0.1)",
                           "instances": [{"instance": 0, "role": "prefill", "first_block": 0, "num_blocks": 3},
                                         {"instance": 1, "role": "decode", "first_block": 3, "num_blocks": 3}]},
    }


# One complete example of every event type (all optional fields set, so a dump equals the input).
EXAMPLES: dict[str, dict] = {
    "header": header_fields(),
    "request_arrived": {
        "request_id": "r0",
        "seq_id": 0,
        "prompt_token_ids": [5, 6, 7],
        "prompt_text": "abc",
        "sampling": {"temperature": 0.8, "top_p": 0.9},
        "max_tokens": 8,
    },
    "request_rejected": {"request_id": "r9", "field": "max_tokens", "reason": "must be > 0"},
    "iteration": {
        "batch": [
            {"request_id": "r0", "seq_id": 0, "phase": "verify", "num_query_tokens": 3, "context_len": 9,
             "num_draft_tokens": 2, "instance": 1}
        ],
        "num_batched_tokens": 3,
        "token_budget": 256,
        "num_running": 1,
        "num_waiting": 0,
        "kv_blocks_used": 1,
        "duration_s": 0.01,
        "execute_s": 0.008,
        "max_num_seqs": 4,
        "intensity": 12.5,
        "bound": "memory",
        "allreduce": {"count": 12, "bytes": 12288, "ms": 1.5},
        "instances": [{"instance": 0, "num_batched_tokens": 0, "num_running": 0, "num_waiting": 0,
                       "kv_blocks_used": 0, "duration_s": 0.0001},
                      {"instance": 1, "num_batched_tokens": 3, "num_running": 1, "num_waiting": 0,
                       "kv_blocks_used": 1, "duration_s": 0.01}],
    },
    "block_alloc": {"block_id": 0, "seq_id": 0, "request_id": "r0", "logical_index": 0},
    "block_free": {"block_id": 0, "seq_id": 0, "request_id": "r0", "cached": True},
    "block_share": {
        "block_id": 0,
        "seq_id": 1,
        "request_id": "r1",
        "logical_index": 0,
        "ref_count": 2,
        "reason": "prefix_cache",
    },
    "block_copy": {"src_block_id": 0, "dst_block_id": 1, "seq_id": 1},
    "block_evict": {"block_id": 0},
    "attention_mask": {
        "request_id": "r0",
        "seq_id": 0,
        "kind": "chunked_prefill",
        "query_positions": [4, 8],
        "key_len": 8,
    },
    "token": {
        "request_id": "r0",
        "seq_id": 0,
        "position": 3,
        "token_id": 42,
        "text": "x",
        "logprob": -0.5,
        "source": "target",
        "dist": {
            "top": [[42, "x", 0.5, 0.6], [7, "y", 0.3, 0.4]],
            "temperature": 0.8,
            "top_k": 0,
            "top_p": 0.9,
            "min_p": 0.0,
            "masked": [[9, "z", 0.2]],
            "raw_probs_f32": "AAAAPw==",  # the whole row of a recorded token (base64 float32: [0.5])
        },
        "top_logprobs": [[42, "x", -0.69], [7, "y", -1.2]],
        "num_allowed": 12,
        "masked_mass": 0.25,
    },
    "spec_propose": {"request_id": "r0", "seq_id": 0, "token_ids": [1, 2], "q_probs": [0.9, 0.5], "method": "draft",
                     "draft_seq_id": 7, "position": 12, "token_texts": ["a", "b"]},
    "spec_verify": {
        "request_id": "r0",
        "seq_id": 0,
        "results": [{"token_id": 1, "p": 0.8, "q": 0.9, "accepted": True, "text": "a"}],
        "num_accepted": 1,
        "resampled_token_id": None,
        "bonus_token_id": 3,
        "position": 12,
        "dists": [[[1, "a", 0.8, 0.9]], [[3, "c", 0.5, 0.0]]],
        "expected_accept": [0.8],
    },
    "seq_fork": {"request_id": "r0", "parent_seq_id": 0, "seq_id": 1, "position": 9},
    "seq_end": {"request_id": "r0", "seq_id": 1, "reason": "pruned"},
    "preempt": {"request_id": "r0", "seq_id": 0, "num_blocks_freed": 2, "mode": "recompute"},
    "request_finished": {
        "request_id": "r0",
        "seq_id": 0,
        "finish_reason": "abort",
        "output_token_ids": [42],
        "output_text": "x",
        "ttft_s": 0.1,
        "tpot_s": None,
        "e2e_s": 0.2,
        "queue_s": 0.05,
        "transfer_s": 0.001,
        "reason": "client disconnected",
        "outputs": [{"seq_id": 0, "output_token_ids": [42], "output_text": "x", "finish_reason": "abort",
                     "cumulative_logprob": -1.5, "score": None}],
        "num_cached_prompt_tokens": 0,
    },
    "kv_transfer": {"request_id": "r0", "seq_ids": [0], "src_instance": 0, "dst_instance": 1, "src_blocks": [0, 1],
                    "dst_blocks": [3, 4], "bytes": 16416, "link_s": 0.0007},
    "metrics": {
        "tokens_per_s": 120.5,
        "kv_usage": 0.5,
        "kv_waste": 0.1,
        "prefix_hit_rate": 0.25,
        "num_preemptions": 0,
        "num_running": 1,
        "num_waiting": 2,
        "kv_blocks_saved_by_sharing": 3,
        "spec_acceptance_rate": 0.5,
        "spec_alpha": 0.6,
        "spec_tokens_per_verify": 2.0,
    },
    "run_finished": {"num_steps": 12, "reason": "all requests finished"},
    "error": {"message": "the run failed (RuntimeError: boom)", "fatal": True},
    "control": {"action": "speed", "value": 2.0},
}


def example(type_: str, seq: int = 0) -> dict:
    return {"type": type_, "seq": seq, "step": 0, "t": 0.5, **EXAMPLES[type_]}


def fake_clock(start: float = 100.0, tick: float = 0.25):
    return (start + tick * i for i in itertools.count()).__next__


# -- schema ------------------------------------------------------------------------------------


def test_examples_cover_every_event_type():
    assert set(EXAMPLES) == set(EVENT_TYPES)


@pytest.mark.parametrize("type_", EVENT_TYPES)
def test_each_event_type_round_trips(type_):
    event = example(type_)
    parsed = parse_event(event)
    assert parsed.type == type_
    assert parsed.model_dump(mode="json") == event
    assert parse_event(json.loads(parsed.model_dump_json())).model_dump(mode="json") == event


@pytest.mark.parametrize("type_", EVENT_TYPES)
def test_a_field_the_schema_does_not_declare_is_rejected(type_):
    with pytest.raises(ValidationError) as info:
        parse_event({**example(type_), "prefix_hash": "ab12"})
    assert describe_error(info.value) == f"{type_} event: field 'prefix_hash': Extra inputs are not permitted"


def test_an_undeclared_field_inside_an_event_is_rejected_too():
    event = example("iteration")
    event["batch"] = [{**event["batch"][0], "phase_counts": 1}]
    with pytest.raises(ValidationError) as info:
        parse_event(event)
    assert "batch.0.phase_counts" in describe_error(info.value)


def test_token_without_dist_is_valid_for_summary_traces():
    event = example("token")
    del event["dist"], event["top_logprobs"]
    assert parse_event(event).dist is None


def test_unknown_type_is_rejected_clearly():
    with pytest.raises(ValidationError) as info:
        parse_event({"type": "bogus", "seq": 0, "step": 0, "t": 0.0})
    assert describe_error(info.value) == "unknown event type 'bogus'"


def test_missing_required_field_is_named():
    event = example("block_alloc")
    del event["block_id"]
    with pytest.raises(ValidationError) as info:
        parse_event(event)
    assert describe_error(info.value) == "block_alloc event: field 'block_id': Field required"


def test_missing_type_is_named():
    with pytest.raises(ValidationError) as info:
        parse_event({"seq": 0, "step": 0, "t": 0.0})
    assert describe_error(info.value) == "missing field 'type'"


def test_json_schema_lists_every_type():
    schema = json_schema()
    assert set(schema["discriminator"]["mapping"]) == set(EVENT_TYPES)
    json.dumps(schema)


# -- bus ---------------------------------------------------------------------------------------


def test_bus_numbers_steps_and_times_events():
    bus = EventBus(clock=fake_clock(start=100.0, tick=0.25))
    seen = []
    bus.subscribe(seen.append)
    first = bus.emit("header", **header_fields())
    bus.step = 0
    second = bus.emit("block_alloc", **EXAMPLES["block_alloc"])
    assert (first["type"], first["seq"], first["step"], first["t"]) == ("header", 0, -1, 0.25)
    assert (second["seq"], second["step"], second["t"]) == (1, 0, 0.5)
    assert seen == [first, second]
    parse_event(first), parse_event(second)


def test_unsubscribe_stops_delivery_and_order_is_kept():
    bus = EventBus()
    calls = []
    bus.subscribe(lambda e: calls.append(("a", e["seq"])))
    stop_b = bus.subscribe(lambda e: calls.append(("b", e["seq"])))
    bus.emit("block_evict", block_id=1)
    stop_b()
    bus.emit("block_evict", block_id=2)
    assert calls == [("a", 0), ("b", 0), ("a", 1)]


def emitted_types(level: str) -> list[str]:
    bus = EventBus(level=level)
    seen = []
    bus.subscribe(seen.append)
    for type_ in EVENT_TYPES:
        bus.emit(type_, **EXAMPLES[type_])
    return [e["type"] for e in seen]


def test_full_level_emits_everything():
    assert emitted_types("full") == list(EVENT_TYPES)


def test_summary_drops_detail_but_never_block_events():
    kept = emitted_types("summary")
    assert "attention_mask" not in kept and "spec_propose" not in kept
    assert {"block_alloc", "block_free", "block_share", "block_copy", "block_evict", "token"} <= set(kept)
    bus = EventBus(level="summary")
    token = bus.emit("token", **EXAMPLES["token"])
    assert "dist" not in token and token["seq"] == 0
    assert not bus.wants("attention_mask") and bus.wants("block_free") and not bus.wants_dist


def test_off_keeps_only_request_lifecycle_and_metrics():
    assert emitted_types("off") == [
        "header",
        "request_arrived",
        "request_rejected",
        "request_finished",
        "metrics",
        "run_finished",
        "error",
    ]


def test_dropped_events_do_not_use_up_seq_numbers():
    bus = EventBus(level="off")
    assert bus.emit("block_evict", block_id=0) is None
    assert bus.emit("metrics", **EXAMPLES["metrics"])["seq"] == 0


def test_bad_level_is_refused():
    with pytest.raises(ValueError, match="events level"):
        EventBus(level="verbose")


# -- trace -------------------------------------------------------------------------------------


def test_trace_round_trip(tmp_path):
    path = tmp_path / "run.jsonl"
    bus = EventBus(clock=fake_clock())
    emitted = []
    bus.subscribe(emitted.append)
    with TraceWriter(path, flush_every=2) as writer:
        bus.subscribe(writer)
        for type_ in EVENT_TYPES:
            bus.emit(type_, **EXAMPLES[type_])
    assert read_trace(path) == emitted
    assert path.read_text().splitlines()[1].startswith('{"type":"request_arrived","seq":1,')


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def test_read_trace_names_the_line_that_is_not_json(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_lines(path, [json.dumps(example("header")), "{not json"])
    with pytest.raises(TraceError, match=rf"^{path}:2: not JSON"):
        read_trace(path)


def test_read_trace_names_unknown_types_and_missing_fields(tmp_path):
    path = tmp_path / "bad.jsonl"
    no_block = {k: v for k, v in example("block_free", seq=2).items() if k != "block_id"}
    lines = [example("header"), example("block_evict", seq=1), no_block]
    write_lines(path, [json.dumps(event) for event in lines])
    with pytest.raises(TraceError, match=rf"^{path}:3: block_free event: field 'block_id': Field required"):
        read_trace(path)
    lines = [example("header"), {"type": "nope", "seq": 1, "step": 0, "t": 0}]
    write_lines(path, [json.dumps(event) for event in lines])
    with pytest.raises(TraceError, match=rf"^{path}:2: unknown event type 'nope'"):
        read_trace(path)


def test_read_trace_wants_a_header_first(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_lines(path, [json.dumps(example("block_evict"))])
    with pytest.raises(TraceError, match=rf"^{path}:1: the first event must be a header"):
        read_trace(path)


def test_strip_times_removes_wall_clock_fields():
    stripped = strip_times([example(t) for t in ("header", "iteration", "request_finished", "metrics")])
    assert all("t" not in e for e in stripped)
    assert "run_id" not in stripped[0] and "duration_s" not in stripped[1]
    assert not {"ttft_s", "tpot_s", "e2e_s", "queue_s"} & set(stripped[2]) and "tokens_per_s" not in stripped[3]
    assert stripped[3]["kv_usage"] == 0.5


# -- reducer -----------------------------------------------------------------------------------


def block_story(cow_order: str = "alloc_first") -> list[dict]:
    """Six blocks: a prefix hit, a fork, a copy-on-write, frees of shared blocks, eviction."""
    bus = EventBus(clock=fake_clock())
    events = []
    bus.subscribe(events.append)

    def alloc(block, seq, rid, index):
        bus.emit("block_alloc", block_id=block, seq_id=seq, request_id=rid, logical_index=index)

    def share(block, seq, rid, index, refs, reason="prefix_cache"):
        bus.emit(
            "block_share",
            block_id=block,
            seq_id=seq,
            request_id=rid,
            logical_index=index,
            ref_count=refs,
            reason=reason,
        )

    def free(block, seq, rid, cached):
        bus.emit("block_free", block_id=block, seq_id=seq, request_id=rid, cached=cached)

    bus.emit("header", **header_fields(num_blocks=6))
    bus.step = 0
    alloc(0, 0, "r0", 0)
    alloc(1, 0, "r0", 1)  # seq 0: [0, 1]
    share(0, 1, "r1", 0, refs=2)  # r1 has r0's first block as prefix
    alloc(2, 1, "r1", 1)  # seq 1: [0, 2]
    share(0, 2, "r1", 0, refs=3, reason="fork")  # seq 2 forks seq 1 (n = 2)
    share(2, 2, "r1", 1, refs=2, reason="fork")
    bus.step = 1
    if cow_order == "alloc_first":  # seq 2 writes into the shared tail block: copy-on-write
        alloc(3, 2, "r1", 1)
        bus.emit("block_copy", src_block_id=2, dst_block_id=3, seq_id=2)
    else:
        bus.emit("block_copy", src_block_id=2, dst_block_id=3, seq_id=2)
        alloc(3, 2, "r1", 1)
    free(2, 2, "r1", cached=False)  # still used by seq 1: only its count drops
    bus.step = 2
    free(1, 0, "r0", cached=True)  # r0 finishes, tail first
    free(0, 0, "r0", cached=True)
    share(1, 3, "r2", 0, refs=1)  # r2 hits r0's freed-but-cached block 1
    alloc(4, 3, "r2", 1)
    bus.step = 3
    free(2, 1, "r1", cached=True)  # seq 1 finishes
    free(0, 1, "r1", cached=True)
    alloc(5, 3, "r2", 2)
    free(3, 2, "r1", cached=False)  # seq 2 finishes
    free(0, 2, "r1", cached=True)
    bus.emit("block_evict", block_id=2)
    return events


def replay(events, state=None) -> RunState:
    state = state or RunState()
    for event in events:
        state.apply(event)
    return state


def test_story_events_are_valid():
    for event in block_story():
        parse_event(event)


def test_copy_on_write_gives_the_fork_its_own_tail_block():
    events = block_story()
    state = replay(events[: 1 + 6 + 3])
    assert state.block_tables == {0: [0, 1], 1: [0, 2], 2: [0, 3]}
    assert state.ref_counts == {0: 3, 1: 1, 2: 1, 3: 1}
    assert state.block_owner == {0: {0, 1, 2}, 1: {0}, 2: {1}, 3: {2}}
    assert state.free_blocks == [4, 5]


def test_freed_cached_block_is_revived_by_a_prefix_hit():
    events = block_story()
    state = replay(events[: 1 + 6 + 3 + 2])
    assert state.free_blocks == [4, 5, 1] and state.cached_blocks == {1}
    assert state.ref_counts[0] == 2 and 0 not in state.block_tables
    state = replay(events[12:14], state)
    assert state.free_blocks == [5] and state.cached_blocks == set()
    assert state.block_tables[3] == [1, 4]


@pytest.mark.parametrize("cow_order", ["alloc_first", "copy_first"])
def test_block_story_ends_in_exact_tables_refs_and_free_list(cow_order):
    state = replay(block_story(cow_order))
    assert state.block_tables == {3: [1, 4, 5]}
    assert state.ref_counts == {1: 1, 4: 1, 5: 1}
    assert state.block_owner == {1: {3}, 4: {3}, 5: {3}}
    assert state.free_blocks == [2, 3, 0]
    assert state.cached_blocks == {0}  # 2 was evicted, 3 was never cacheable
    assert state.seq_request == {0: "r0", 1: "r1", 2: "r1", 3: "r2"}
    assert (state.step, state.last_seq) == (3, 19)
    assert state.model["name"] == "demo" and state.cache["num_blocks"] == 6


def request_story() -> list[dict]:
    bus = EventBus(clock=fake_clock())
    events = []
    bus.subscribe(events.append)

    def iteration(*entries):
        batch = [
            {"request_id": rid, "seq_id": seq, "phase": phase, "num_query_tokens": 1, "context_len": 3}
            for rid, seq, phase in entries
        ]
        bus.emit("iteration", **{**EXAMPLES["iteration"], "batch": batch})

    def token(rid, seq, token_id, text):
        fields = {"request_id": rid, "seq_id": seq, "token_id": token_id, "text": text}
        bus.emit("token", **{**EXAMPLES["token"], **fields})

    bus.emit("header", **header_fields(num_blocks=4))
    bus.emit("request_arrived", **EXAMPLES["request_arrived"])
    bus.emit("request_arrived", **{**EXAMPLES["request_arrived"], "request_id": "r1"})
    bus.emit("request_rejected", **EXAMPLES["request_rejected"])
    bus.step = 0
    bus.emit("block_alloc", block_id=0, seq_id=0, request_id="r0", logical_index=0)
    iteration(("r0", 0, "prefill"))
    token("r0", 0, 10, "a")
    bus.step = 1
    bus.emit("block_alloc", block_id=1, seq_id=1, request_id="r1", logical_index=0)
    iteration(("r0", 0, "decode"), ("r1", 1, "prefill"))
    token("r0", 0, 11, "b")
    token("r1", 1, 12, "c")
    bus.emit("metrics", **EXAMPLES["metrics"])
    bus.step = 2
    bus.emit("preempt", request_id="r1", seq_id=1, num_blocks_freed=1, mode="recompute")
    bus.emit("block_free", block_id=1, seq_id=1, request_id="r1", cached=True)
    iteration(("r0", 0, "decode"))
    token("r0", 0, 13, "d")
    bus.emit("block_free", block_id=0, seq_id=0, request_id="r0", cached=True)
    finished = {"finish_reason": "length", "output_token_ids": [10, 11, 13], "output_text": "abd"}
    bus.emit("request_finished", **{**EXAMPLES["request_finished"], **finished, "reason": None})
    bus.emit("control", action="pause")
    return events


def test_queues_follow_arrival_scheduling_preemption_and_finish():
    events = request_story()
    state = replay(events[:4])
    assert state.waiting == ["r0", "r1"] and state.running == []
    assert state.requests["r9"].status == "rejected"
    state = replay(events[4:11], state)
    assert state.running == ["r0", "r1"] and state.waiting == []
    assert state.requests["r0"].output_text == "ab" and state.requests["r0"].first_token_step == 0
    state = replay(events[11:14], state)
    assert state.waiting == ["r1"] and state.running == ["r0"]
    assert state.requests["r1"].status == "preempted" and state.num_preemptions == 1
    assert state.free_blocks == [2, 3, 1]
    state = replay(events[14:], state)
    r0 = state.requests["r0"]
    assert (r0.status, r0.output_token_ids, r0.output_text) == ("finished", [10, 11, 13], "abd")
    assert (r0.finish_reason, r0.finish_step) == ("length", 2)
    assert state.running == [] and state.waiting == ["r1"]
    assert state.last_token_by_request["r0"]["token_id"] == 13
    assert state.metrics["kv_usage"] == 0.5
    assert "paused" not in state.snapshot()  # the closing control is the served run's pacing, not engine state
    assert [it["step"] for it in state.iterations] == [0, 1, 2]


def test_pacing_follows_the_control_events_as_the_run_obeys_them():
    pacing = Pacing.from_snapshot({"paused": True, "speed": 4.0, "lesson": False, "step": 3})
    steps = [  # (action, value) -> (paused, speed, lesson) after it
        ("resume", None, (False, 4.0, False)), ("speed", 0.0, (False, 0.0, False)), ("lesson", 1, (False, 0.0, True)),
        ("pause", "preempt", (True, 0.0, True)), ("resume", None, (False, 0.0, True)), ("step", 1, (True, 0.0, True)),
        ("seek", 2, (True, 0.0, True)),
    ]  # fmt: skip
    for action, value, expected in steps:
        pacing.apply_control({**example("control"), "action": action, "value": value})
        assert (pacing.paused, pacing.speed, pacing.lesson) == expected, action
    assert Pacing.from_snapshot(RunState().snapshot()) == Pacing()  # a bare reducer's snapshot tells none


def test_iterations_keep_only_the_last_k():
    events = request_story()
    state = replay(events, RunState(max_iterations=2))
    assert [it["step"] for it in state.iterations] == [1, 2]


def test_every_field_of_the_plain_model_goes_through_a_snapshot_and_back():
    """PlainState is the one list of the fields a snapshot carries as they are: a field added there
    reaches the snapshot and comes back from it with no other edit."""
    state = RunState()
    for name in PLAIN_FIELDS:
        setattr(state, name, [name])  # a value no field has by default
    snapshot = json.loads(json.dumps(state.snapshot()))
    again = RunState.from_snapshot(snapshot)
    assert {name: getattr(again, name) for name in PLAIN_FIELDS} == {name: [name] for name in PLAIN_FIELDS}


@pytest.mark.parametrize("story", [block_story, request_story])
def test_snapshot_then_more_events_equals_replaying_everything(story):
    events = story()
    expected = replay(events)
    for split in range(1, len(events) + 1):
        through_json = json.loads(json.dumps(replay(events[:split]).snapshot()))
        resumed = replay(events[split:], RunState.from_snapshot(through_json))
        assert resumed.snapshot() == expected.snapshot(), f"split at event {split}"
        assert resumed.block_owner == expected.block_owner
