"""Every event a real run emits is exactly what the schema declares: no missing field, no extra one.

The schema forbids undeclared fields, so a field a producer adds without declaring it (or a field
the schema declares that the engine spells differently) fails here, for each kind of run.
"""

from __future__ import annotations

import re

import pytest

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.schema import parse_event
from kvscope.backend.events.state import RunState
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario

PROMPT = "KING HENRY:\nOnce more unto the breach, dear friends,"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# name -> (engine settings, requests): each small, each exercising the events of one kind of run
RUNS = {
    "plain": ({"block_size": 4, "num_blocks": 64, "prefix_caching": True},
              [{"id": "a", "prompt": PROMPT, "max_tokens": 4, "sampling": {**GREEDY, "logprobs": 2}},
               {"id": "b", "prompt": PROMPT, "max_tokens": 3, "arrival_step": 2, "sampling": GREEDY}]),
    "speculative": ({"block_size": 4, "num_blocks": 64,
                     "speculative": {"method": "draft", "draft_model": "demo-draft", "num_tokens": 2}},
                    [{"id": "a", "prompt": PROMPT, "max_tokens": 5, "sampling": GREEDY}]),
    "ngram": ({"block_size": 4, "num_blocks": 64, "speculative": {"method": "ngram", "num_tokens": 2}},
              [{"id": "a", "prompt": PROMPT, "max_tokens": 5, "sampling": GREEDY}]),
    "beams-and-n": ({"block_size": 4, "num_blocks": 96},
                    [{"id": "beams", "prompt": PROMPT, "max_tokens": 4,
                      "sampling": {"beam_width": 2, "n": 2, "ignore_eos": True}},
                     {"id": "n", "prompt": PROMPT, "max_tokens": 4, "sampling": {"temperature": 1.0, "seed": 1, "n": 2}}]),
    "preemption": ({"block_size": 4, "num_blocks": 12, "max_num_seqs": 4, "prefix_caching": False},
                   [{"id": f"r{i}", "prompt": PROMPT[: 12 + i], "max_tokens": 14, "sampling": GREEDY}
                    for i in range(3)]),
    "kv-cache-off": ({"block_size": 4, "num_blocks": 64, "kv_cache": False},
                     [{"id": "a", "prompt": PROMPT, "max_tokens": 3, "sampling": GREEDY}]),
}


def events_of(name: str) -> list[dict]:
    engine, requests = RUNS[name]
    scenario = Scenario.model_validate({"name": f"strict-{name}", "model": "demo", "seed": 0,
                                        "engine": {**engine, "events": "full"}, "requests": requests})
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    ScenarioRun(scenario, bus=bus).run()
    return events


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_emitted_event_validates_strictly(name):
    events = events_of(name)
    for event in events:
        parse_event(event)  # raises on a missing, mistyped or undeclared field
    kinds = {e["type"] for e in events}
    assert {"header", "request_arrived", "iteration", "token", "request_finished", "run_finished"} <= kinds
    assert sum(e["type"] == "run_finished" for e in events) == 1
    for it in (e for e in events if e["type"] == "iteration" and e["batch"]):
        # The step's clock split in two, the executor's share measured (the fixed cost's source, roofline.py)
        assert 0 < it["execute_s"] <= it["duration_s"], it
    expected = {"speculative": "spec_verify", "ngram": "spec_verify", "beams-and-n": "seq_fork",
                "preemption": "preempt", "plain": "block_share"}.get(name)
    assert expected is None or expected in kinds, f"the {name} run did not exercise {expected}"


def test_the_reducer_knows_every_sequence_of_a_request_from_the_events():
    state = RunState()
    events = events_of("beams-and-n")
    for event in events:
        state.apply(event)
    for rid in ("beams", "n"):
        forks = [e["seq_id"] for e in events if e["type"] == "seq_fork" and e["request_id"] == rid]
        first = next(e["seq_id"] for e in events if e["type"] == "request_arrived" and e["request_id"] == rid)
        assert forks and state.requests[rid].seq_ids == [first, *forks]


def test_a_request_of_several_sequences_keeps_each_ones_reply_apart():
    """#38: n = 2 wrote "and my the And king lord soul", both sequences' tokens in arrival order. The first
    sequence's reply stays its own, and the request panel gives each sequence its own line (beams too)."""
    from kvscope.backend.events.record import RunRecord
    from kvscope.frontend.text import request_text

    events = events_of("beams-and-n")
    for rid in ("n", "beams"):
        end = next(k for k, e in enumerate(events) if e["type"] == "request_finished" and e["request_id"] == rid)
        record = RunRecord.from_events(events[:end])  # the moment before it finished
        view = record.state.requests[rid]
        first, *others = view.seq_ids
        mine = [e for e in events[:end] if e["type"] == "token" and e["request_id"] == rid]
        assert view.output_text == "".join(e["text"] for e in mine if e["seq_id"] == first)
        shown = request_text(view, record.state, record.history)
        assert f"{len(view.seq_ids)} sequences:" in shown
        for seq in view.seq_ids:
            text = "".join(t.event["text"] for t in record.history.seq_output(record.state, seq))
            assert f"sequence {seq}" in shown and text in shown
        if rid == "n":  # two independent samples: neither line holds the other's tokens
            texts = {e["seq_id"]: "".join(t["text"] for t in mine if t["seq_id"] == e["seq_id"]) for e in mine}
            for seq, text in texts.items():  # each sequence's own tokens, whole, and nothing of the other's
                assert re.search(rf"sequence {seq}( \(\w+\))?: {re.escape(text)}\n(  sequence|prompt)", shown), shown
        finished = RunRecord.from_events(events[:end + 1])
        assert "replies, best first:" in request_text(finished.state.requests[rid], finished.state, finished.history)
