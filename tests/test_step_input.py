"""The step as data (#23, #34): the scheduler's decision is ids and ints; what the executor computes and
samples is a StepInput of plain values that pickles, with no object of the engine's in it; what it hands
back is a StepOutput of token ids and numbers; the draft pass is the same (a DraftInput in, drafted ids
out, never a distribution); and an executor given only pickled copies, answering with pickled copies,
still generates what the plain reference model does (speculative verification and a draft model included)."""

from __future__ import annotations

import dataclasses
import pickle

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.reference import reference_generate
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.scheduler_output import SchedulerOutput
from kvscope.backend.engine.step_input import DraftInput, StepInput
from kvscope.backend.engine.step_output import DraftOutput, StepOutput
from tests.engine_helpers import GREEDY, mixed_workload


def plain(value) -> bool:
    """Numbers, strings, settings and tensors, in lists, tuples and dataclasses: nothing that points back
    into the engine (no Sequence, no Request, no generator)."""
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(plain(k) and plain(v) for k, v in value.items())
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


def copy(value):
    return pickle.loads(pickle.dumps(value))


def run_on_copies(model, draft=None, **config) -> tuple[list, list, Engine]:
    """Run a mixed workload with the executor fed pickled copies of each StepInput and DraftInput, its answers
    handed back as pickled copies; what went in (SchedulerOutputs too), what came back, and the engine."""
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=48, **config),
                    draft=draft)
    seen: list = []
    answers: list = []
    executor, scheduler = engine.executor, engine.scheduler
    execute, propose, schedule = executor.execute, executor.propose, scheduler.schedule

    def through_copies(call):
        def called(inp):
            seen.append(inp)
            answers.append(call(copy(inp)))
            return copy(answers[-1])
        return called

    def scheduled(now: float) -> SchedulerOutput:
        seen.append(schedule(now))
        return seen[-1]

    executor.execute, executor.propose, scheduler.schedule = through_copies(execute), through_copies(propose), scheduled
    for rid, _, prompt, max_tokens in mixed_workload(model, count=8):
        engine.add_request(rid, prompt, max_tokens, GREEDY)
    while engine.has_unfinished() and engine.step_no < 2000:
        engine.step()
    return seen, answers, engine


def step_inputs(seen: list) -> list[StepInput]:
    return [inp for inp in seen if isinstance(inp, StepInput)]


def test_the_schedulers_decision_is_ids_and_ints(tiny) -> None:
    seen, _, _ = run_on_copies(tiny, chunked_prefill=True, prefix_caching=True)
    plans = [plan for plan in seen if isinstance(plan, SchedulerOutput)]
    assert plans and any(plan.rows for plan in plans)
    for plan in plans:
        for row in plan.rows:
            assert all(isinstance(getattr(row, f.name), (int, str, tuple)) for f in dataclasses.fields(row))
        assert all(isinstance(pair, tuple) and all(isinstance(b, int) for b in pair) for pair in plan.block_copies)
        assert plain(plan.outputs), "what scheduling did is plain records"


def test_every_step_input_and_output_is_plain_data_that_pickles(tiny) -> None:
    seen, answers, _ = run_on_copies(tiny, chunked_prefill=True, prefix_caching=True)
    phases = set()
    for inp, out in zip(step_inputs(seen), answers, strict=True):
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
    verifies = [(inp, i) for inp in step_inputs(seen) for i, phase in enumerate(inp.phases) if phase == "verify"]
    assert verifies
    for inp, i in verifies:
        assert set(range(inp.query_starts[i], inp.query_starts[i + 1])) <= set(inp.logit_rows)
        drafts = inp.sampling[i].drafts  # fed after the last token, judged by the executor
        assert drafts and inp.input_ids[inp.query_starts[i + 1] - len(drafts):inp.query_starts[i + 1]] == drafts
    eos = tiny.tokenizer.eos_token_ids
    for rid, _, prompt, max_tokens in mixed_workload(tiny, count=8):
        expected = reference_generate(tiny.model, prompt, max_tokens, GREEDY, eos)
        assert engine.requests[rid].seq.output_token_ids == expected, rid


def test_a_draft_model_drafts_through_the_executor_and_hands_back_ids(demo, draft) -> None:
    """The draft pass is a second executor call: a DraftInput of plain values in (the draft model's blocks
    already reserved by the scheduler), drafted ids out; the distributions the drafts were drawn from stay
    in the executor for the verify, and the output is still the reference's."""
    seen, answers, engine = run_on_copies(demo, draft, speculative={"method": "draft", "draft_model": "demo-draft",
                                                                    "num_tokens": 3})
    drafts = [(inp, out) for inp, out in zip([i for i in seen if not isinstance(i, SchedulerOutput)], answers,
                                             strict=True) if isinstance(inp, DraftInput)]
    assert drafts and any(inp.rows for inp, _ in drafts)
    for inp, out in drafts:
        assert plain(inp) and isinstance(out, DraftOutput)
        assert all(isinstance(t, int) for ids in out.token_ids for t in ids)  # ids and numbers, no tensor
        assert all(isinstance(q, float) for qs in out.q_probs for q in qs)
        for row, ids in zip(inp.rows, out.token_ids, strict=True):
            assert len(ids) == row.num_drafts
            assert len(row.block_table) * 4 >= len(row.token_ids) + row.num_drafts - 1  # every slot it writes
    verifies = [inp for inp in step_inputs(seen) if "verify" in inp.phases]
    assert verifies
    for rid, _, prompt, max_tokens in mixed_workload(demo, count=8):
        assert engine.requests[rid].seq.output_token_ids == \
            reference_generate(demo.model, prompt, max_tokens, GREEDY, demo.tokenizer.eos_token_ids), rid
