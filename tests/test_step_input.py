"""The step as data (#23): what the executor computes and samples is a StepInput of plain values that
pickles, with no object of the engine's in it; what it hands back is a StepOutput of token ids and
numbers; and an executor given only pickled copies, answering with pickled copies, still generates
what the plain reference model does (speculative verification included)."""

from __future__ import annotations

import dataclasses
import pickle

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.reference import reference_generate
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.step_input import StepInput
from kvscope.backend.engine.step_output import StepOutput
from tests.engine_helpers import GREEDY, mixed_workload


def plain(value) -> bool:
    """Numbers, strings, settings and tensors, in lists, tuples and dataclasses: nothing that points back
    into the engine (no Sequence, no Request, no generator)."""
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    if dataclasses.is_dataclass(value):
        return all(plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return value is None or isinstance(value, (int, float, str, SamplingParams, torch.Tensor))


def same(a, b) -> bool:
    """Equality that compares tensors by value (a dataclass's == would ask a tensor for one truth value)."""
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def run_on_copies(tiny, **config) -> tuple[list[StepInput], list[StepOutput], Engine]:
    """Run a mixed workload with the executor fed pickled copies of each StepInput, its StepOutputs handed
    back as pickled copies; the inputs, the outputs and the engine."""
    engine = Engine(tiny, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=48, **config))
    seen: list[StepInput] = []
    answers: list[StepOutput] = []
    execute = engine.runner.execute

    def from_a_copy(inp: StepInput):
        seen.append(inp)
        answers.append(execute(pickle.loads(pickle.dumps(inp))))
        return pickle.loads(pickle.dumps(answers[-1]))

    engine.runner.execute = from_a_copy
    for rid, _, prompt, max_tokens in mixed_workload(tiny, count=8):
        engine.add_request(rid, prompt, max_tokens, GREEDY)
    while engine.has_unfinished() and engine.step_no < 2000:
        engine.step()
    return seen, answers, engine


def test_every_step_input_and_output_is_plain_data_that_pickles(tiny) -> None:
    seen, answers, _ = run_on_copies(tiny, chunked_prefill=True, prefix_caching=True)
    phases = set()
    for inp, out in zip(seen, answers, strict=True):
        for f in dataclasses.fields(inp):
            assert plain(getattr(inp, f.name)), f"StepInput.{f.name} holds more than plain values"
        assert plain(out), "a StepOutput holds more than plain values"
        assert same(pickle.loads(pickle.dumps(inp)), inp) and same(pickle.loads(pickle.dumps(out)), out)
        assert len(out.rows) == inp.num_rows
        for row, how in zip(out.rows, inp.sampling, strict=True):
            assert (row is None) == (how is None)  # a row samples exactly when the scheduler said so
        n = len(inp.input_ids)
        assert inp.query_starts[0] == 0 and inp.query_starts[-1] == n == len(inp.positions) == len(inp.slot_mapping)
        assert all(0 <= r < n for r in inp.logit_rows)
        phases.update(inp.phases)
    assert {"prefill", "decode"} <= phases


def test_a_runner_fed_only_copies_generates_what_the_reference_does(tiny) -> None:
    """Speculative (n-gram) decoding too: a verify row asks for the logits of every one of its positions."""
    seen, answers, engine = run_on_copies(tiny, speculative={"method": "ngram", "num_tokens": 3})
    verifies = [(inp, i) for inp in seen for i, phase in enumerate(inp.phases) if phase == "verify"]
    assert verifies
    for inp, i in verifies:
        assert set(range(inp.query_starts[i], inp.query_starts[i + 1])) <= set(inp.logit_rows)
        drafts = inp.sampling[i].drafts  # fed after the last token, judged by the executor
        assert drafts and inp.input_ids[inp.query_starts[i + 1] - len(drafts):inp.query_starts[i + 1]] == drafts
    eos = tiny.tokenizer.eos_token_ids
    for rid, _, prompt, max_tokens in mixed_workload(tiny, count=8):
        expected = reference_generate(tiny.model, prompt, max_tokens, GREEDY, eos)
        assert engine.requests[rid].seq.output_token_ids == expected, rid
