"""The step's input as plain data (#23): what the runner computes is a StepInput of ints and strings
that pickles, with no object of the engine's in it, and a runner given only pickled copies still
generates what the plain reference model does."""

from __future__ import annotations

import dataclasses
import pickle

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.reference import reference_generate
from kvscope.backend.engine.step_input import StepInput
from tests.engine_helpers import GREEDY, mixed_workload


def plain(value) -> bool:
    """Only ints and strings, in lists and tuples: nothing that points back into the engine."""
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    return isinstance(value, (int, str))


def run_on_copies(tiny, **config) -> tuple[list[StepInput], Engine]:
    """Run a mixed workload with the runner fed pickled copies of each StepInput; the inputs and the engine."""
    engine = Engine(tiny, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=48, **config))
    seen: list[StepInput] = []
    execute = engine.runner.execute

    def from_a_copy(inp: StepInput):
        seen.append(inp)
        return execute(pickle.loads(pickle.dumps(inp)))

    engine.runner.execute = from_a_copy
    for rid, _, prompt, max_tokens in mixed_workload(tiny, count=8):
        engine.add_request(rid, prompt, max_tokens, GREEDY)
    while engine.has_unfinished() and engine.step_no < 2000:
        engine.step()
    return seen, engine


def test_every_step_input_is_plain_data_that_pickles(tiny) -> None:
    seen, _ = run_on_copies(tiny, chunked_prefill=True, prefix_caching=True)
    phases = set()
    for inp in seen:
        for f in dataclasses.fields(inp):
            assert plain(getattr(inp, f.name)), f"StepInput.{f.name} holds more than ints and strings"
        assert pickle.loads(pickle.dumps(inp)) == inp
        n = len(inp.input_ids)
        assert inp.query_starts[0] == 0 and inp.query_starts[-1] == n == len(inp.positions) == len(inp.slot_mapping)
        assert all(0 <= r < n for r in inp.logit_rows)
        phases.update(inp.phases)
    assert {"prefill", "decode"} <= phases


def test_a_runner_fed_only_copies_generates_what_the_reference_does(tiny) -> None:
    """Speculative (n-gram) decoding too: a verify row asks for the logits of every one of its positions."""
    seen, engine = run_on_copies(tiny, speculative={"method": "ngram", "num_tokens": 3})
    verifies = [(inp, i) for inp in seen for i, phase in enumerate(inp.phases) if phase == "verify"]
    assert verifies
    for inp, i in verifies:
        assert set(range(inp.query_starts[i], inp.query_starts[i + 1])) <= set(inp.logit_rows)
    eos = tiny.tokenizer.eos_token_ids
    for rid, _, prompt, max_tokens in mixed_workload(tiny, count=8):
        expected = reference_generate(tiny.model, prompt, max_tokens, GREEDY, eos)
        assert engine.requests[rid].seq.output_token_ids == expected, rid
