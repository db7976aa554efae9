"""A request can only fail itself (#35): a row the executor cannot sample (its grammar leaves no token
allowed, its logits are not numbers) ends that sequence alone, aborted with the reason; every other
request in the batch goes on, the run with them; no NaN reaches an event. A grammar that allows nothing
at its very start is refused at admission; the compiled-grammar cache is bounded in bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.grammar import Grammars
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.request_output import Finished, Token
from kvscope.backend.engine.sample_step import GRAMMAR_STRANDED, NOT_A_NUMBER, sample_step
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.step_input import RowSampling, StepInput
from kvscope.backend.events.bus import encode_event

# A JSON string that may hold no character: after its opening quote nothing is allowed, and it cannot end.
STRANDS = {"json": {"type": "string", "pattern": "[^\\s\\S]"}}


def serve(engine: Engine, requests: list[tuple[str, dict]], max_tokens: int = 12) -> tuple[list, list]:
    events, outputs = [], []
    engine.bus.subscribe(events.append)
    engine.stream_outputs(outputs.append)
    for rid, sampling in requests:
        engine.add_request(rid, "KING HENRY:\n", max_tokens, sampling)
    while engine.has_unfinished():
        engine.step()
    return events, outputs


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_tokens": 3}])
def test_a_grammar_that_strands_its_row_ends_that_request_alone(demo, speculative):
    engine = Engine(demo, EngineConfig(speculative=speculative))
    events, outputs = serve(engine, [("stranded", {"temperature": 0, "structured_outputs": STRANDS}),
                                     ("plain", {"temperature": 0}), ("sampled", {"temperature": 1.0, "seed": 4}),
                                     ("n", {"temperature": 0.9, "seed": 2, "n": 2, "structured_outputs": STRANDS})])
    finished = {o.request_id: o for o in outputs if isinstance(o, Finished)}
    for rid in ("stranded", "n"):
        assert finished[rid].finish_reason == "abort" and GRAMMAR_STRANDED in finished[rid].error
        assert finished[rid].reason == finished[rid].error  # the trace's request_finished says why
    assert [t.text for t in outputs if isinstance(t, Token) and t.request_id == "stranded"] == ['"']
    for rid in ("plain", "sampled"):
        assert finished[rid].finish_reason in ("eos", "length") and finished[rid].error is None
    for e in events:
        encode_event(e)  # raises on NaN or infinity
    assert engine.blocks.num_used_blocks == 0 or engine.config.prefix_caching
    engine.blocks.check_invariants(engine.live_sequences())


def test_a_grammar_that_allows_nothing_at_its_start_is_refused_at_admission(demo):
    engine = Engine(demo, EngineConfig(events="off"))
    for spec, field in [({"regex": "[^\\s\\S]"}, "regex"), ({"grammar": 'root ::= root "a"'}, "grammar")]:
        with pytest.raises(RequestError) as refused:
            engine.add_request("r", "ROMEO:", 4, {"structured_outputs": spec})
        assert refused.value.field == f"sampling.structured_outputs.{field}" and "allows no token" in str(refused.value)
    assert not engine.has_unfinished()


def sampled_row(params: SamplingParams, allowed: torch.Tensor | None = None) -> RowSampling:
    return RowSampling("sample", params, [] if params.greedy else [0.3], allowed=allowed)


def test_the_executor_answers_an_unsampleable_row_with_its_error_and_the_others_with_tokens(demo):
    vocab = demo.config.vocab_size
    nothing = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    logits = torch.randn(3, vocab)
    logits[2, 5] = float("nan")
    rows = [sampled_row(SamplingParams(temperature=0)), sampled_row(SamplingParams(temperature=1.0), nothing),
            sampled_row(SamplingParams(temperature=1.0))]
    inp = StepInput(["a", "b", "c"], [0, 1, 2], ["decode"] * 3, [0, 1, 2, 3], [1, 1, 1], [[0], [1], [2]], [1, 2, 3],
                    [0, 0, 0], [0, 16, 32], [0, 1, 2], [], rows, demo.tokenizer.eos_token_ids, dist_top_n=4)
    out = sample_step(logits, inp).rows
    assert out[0].error is None and len(out[0].token_ids) == 1 and math.isfinite(out[0].logprobs[0])
    assert out[1].error == GRAMMAR_STRANDED and out[1].token_ids == [] and out[1].tops is None
    assert out[2].error == NOT_A_NUMBER and out[2].token_ids == []


def test_a_verify_stranded_after_its_drafts_judges_only_the_drafts_before(demo, draft):
    """Drafts the grammar allows lead to a position where it allows nothing: the executor judges the drafts
    whose positions can be drawn from, and the sequence meets the stranded position in a later step."""
    vocab = demo.config.vocab_size
    width = (vocab + 31) // 32
    allowed = torch.full((4, width), -1, dtype=torch.int32)
    allowed[2] = 0  # after the first two drafts nothing is allowed
    logits = torch.zeros(4, vocab)
    logits[:, 7] = 50.0
    row = RowSampling("verify", SamplingParams(temperature=0), drafts=[7, 7, 7], allowed=allowed)
    inp = StepInput(["r"], [0], ["verify"], [0, 4], [4], [[0]], [0] * 4, list(range(4)), list(range(4)),
                    list(range(4)), [], [row], demo.tokenizer.eos_token_ids, dist_top_n=4)
    out = sample_step(logits, inp).rows[0]
    assert out.error is None and len(out.draft_p) == 1  # one draft judged: its position and the next are fine
    assert out.num_accepted == 1 and out.token_ids == [7, 7] and out.source == "bonus"
    assert all(math.isfinite(x) for x in out.logprobs + out.draft_p + out.expected_accept)


def test_the_grammar_cache_is_bounded_in_bytes_and_drops_the_least_recently_used(demo):
    specs = [SamplingParams(structured_outputs={"regex": f"[a-{c}]+"}).structured_outputs for c in "cdef"]
    measure = Grammars(demo.tokenizer, demo.config.vocab_size, demo.tokenizer.eos_token_ids)
    sizes = [measure.compiled(s).memory_size_bytes for s in specs]
    grammars = Grammars(demo.tokenizer, demo.config.vocab_size, demo.tokenizer.eos_token_ids,
                        max_bytes=sizes[0] + max(sizes[1], sizes[2]))  # room for the first and one more
    grammars.compiled(specs[0])
    grammars.compiled(specs[1])
    assert grammars.cached_bytes == sizes[0] + sizes[1] and grammars.num_compiled == 2
    grammars.compiled(specs[0])  # a hit, and now the most recently used
    grammars.compiled(specs[2])  # evicts the second, not the first
    assert grammars.cached_bytes == sizes[0] + sizes[2] <= grammars.max_bytes
    grammars.compiled(specs[0])
    assert grammars.num_compiled == 3
    grammars.max_bytes = 10  # smaller than any grammar: each is used once, never kept
    grammars.compiled(specs[3])
    grammars.compiled(specs[3])
    assert grammars.num_compiled == 5


def test_an_engine_handed_a_compiled_grammar_compiles_nothing(demo):
    engine = Engine(demo, EngineConfig(events="off"))
    spec = SamplingParams(structured_outputs={"regex": "[0-9]{3}"}).structured_outputs
    other = Grammars(demo.tokenizer, demo.config.vocab_size, demo.tokenizer.eos_token_ids)
    compiled = other.compiled(spec)  # compiled elsewhere (a server's thread)
    engine.add_request("r", "ROMEO:", 5, {"temperature": 0, "structured_outputs": {"regex": "[0-9]{3}"}},
                       grammar=compiled)
    while engine.has_unfinished():
        engine.step()
    assert engine.grammars.num_compiled == 0 and engine.requests["r"].output_text.isdigit()
    assert json.dumps(engine.requests["r"].outputs)  # plain data
