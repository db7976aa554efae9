"""n > 1 and beam search share their blocks: forks, copy-on-write, pruning, and exact results.

Beam search is checked against a brute-force beam search written separately here: every (beam,
token) candidate scored by full recomputation on the reference model, no cache, no top-k shortcut.
"""

from collections import Counter

import pytest
import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.beam_search import select
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.schema import parse_event
from kvscope.backend.events.state import RunState
from kvscope.backend.engine.reference import next_token_logits, reference_generate
from tests.engine_helpers import GREEDY, mixed_workload, run_engine

CONFIG = EngineConfig(block_size=4, num_blocks=400, max_num_seqs=32)


def finished_events(events: list[dict]) -> dict[str, dict]:
    return {e["request_id"]: e for e in events if e["type"] == "request_finished"}


def test_n_sequences_share_the_prompt_and_copy_on_write(demo):
    events, state = [], RunState()
    prompt = demo.tokenizer.encode("MENENIUS:\nWhat work's, my countrymen, in hand? where go you")
    params = SamplingParams(temperature=1.0, seed=7, n=4)
    engine = run_engine(demo, CONFIG, [("multi", 0, prompt, 12)], params, events=events, replay=state)
    forks = [e for e in events if e["type"] == "seq_fork"]
    assert len(forks) == 3 and {e["parent_seq_id"] for e in forks} == {0}
    shares = [e for e in events if e["type"] == "block_share" and e["reason"] == "fork"]
    assert shares and max(e["ref_count"] for e in shares) == 4  # the prompt's blocks held by all four
    assert any(e["type"] == "block_copy" for e in events), "the shared partial block is copied on first write"
    assert max(e["kv_blocks_saved_by_sharing"] for e in events if e["type"] == "metrics") >= 3 * (len(prompt) // 4)
    done = finished_events(events)["multi"]
    assert [o["seq_id"] for o in done["outputs"]] == [0, *[e["seq_id"] for e in forks]]
    assert len({tuple(o["output_token_ids"]) for o in done["outputs"]}) > 1, "sampled siblings diverge"
    # Sequence 0 keeps the request's seed: it draws exactly what n = 1 draws.
    single = run_engine(demo, CONFIG, [("one", 0, prompt, 12)], params.model_copy(update={"n": 1}))
    assert done["outputs"][0]["output_token_ids"] == single.requests["one"].seq.output_token_ids
    assert engine.blocks.num_used_blocks == 0 or CONFIG.prefix_caching
    ends = [e for e in events if e["type"] == "seq_end"]
    assert {e["seq_id"] for e in ends} == {o["seq_id"] for o in done["outputs"]}
    for e in events:
        parse_event(e)


def test_greedy_n_copies_equal_the_reference_in_a_mixed_batch(demo):
    work = mixed_workload(demo, count=10, seed=5)
    engine = run_engine(demo, EngineConfig(block_size=3, num_blocks=900, max_num_batched_tokens=40), work,
                        lambda rid: GREEDY.model_copy(update={"n": 1 + int(rid[1:]) % 3}))
    eos = demo.tokenizer.eos_token_ids
    for rid, _, prompt, max_tokens in work:
        expected = reference_generate(demo.model, prompt, max_tokens, GREEDY, eos)
        req = engine.requests[rid]
        assert len(req.seqs) == req.params.n
        assert all(s.output_token_ids == expected for s in req.seqs)


def test_parallel_samples_are_the_same_alone_and_in_a_crowd(demo):
    prompt = demo.tokenizer.encode("CORIOLANUS:\nThey said they were an-hungry")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3, n=3)
    alone = run_engine(demo, CONFIG, [("x", 0, prompt, 10)], params)
    crowd = run_engine(demo, CONFIG, [("x", 2, prompt, 10)] + mixed_workload(demo, count=8, seed=9),
                       lambda rid: params if rid == "x" else SamplingParams(temperature=1.0, seed=1, n=2))
    assert [s.output_token_ids for s in alone.requests["x"].seqs] == [s.output_token_ids
                                                                     for s in crowd.requests["x"].seqs]


# ---- beam search --------------------------------------------------------------------------------


def brute_force_beam_search(model, prompt: list[int], width: int, max_tokens: int, eos: list[int],
                            length_penalty: float) -> list[tuple[list[int], float]]:
    """Every (beam, token) scored by recomputing the whole sequence; returns (tokens, cum logprob) best first."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        candidates = []
        for b, (tokens, cum) in enumerate(beams):
            logprobs = torch.log_softmax(next_token_logits(model, prompt + tokens).float(), dim=-1).tolist()
            candidates += [(cum + lp, b, t) for t, lp in enumerate(logprobs)]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        kept = []
        for rank, (score, b, t) in enumerate(candidates):
            if len(kept) == width:
                break
            if t in eos:
                if rank < width:
                    finished.append((beams[b][0] + [t], score))
                continue
            kept.append((beams[b][0] + [t], score))
        beams = kept
        if len(finished) >= width:
            break
        if len(beams[0][0]) == max_tokens:
            finished += beams
    return sorted(finished, key=lambda h: -h[1] / len(h[0]) ** length_penalty)


CASES = [  # (prompt, width, max_tokens, length_penalty)
    ("KING HENRY:\nOnce more unto the breach", 2, 6, 1.0),
    ("JULIET:\nGood night, good night! parting is such sweet sorrow", 3, 8, 0.5),
    ("HAMLET:\nTo be, or not to be", 4, 5, 2.0),
    ("ROMEO:\nI will.", 3, 10, 1.0),
    # Lines about to end: EOS candidates finish hypotheses, some ranked too low to count.
    ("JULIET:\nAy me", 3, 6, 1.0),
    ("ROMEO:\nI will", 2, 6, 1.0),
    ("LUCIO:\nFare you well", 4, 6, 0.0),
    ("GLOUCESTER:\nAnd so we will", 3, 6, 2.0),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_beam_search_equals_brute_force(case, demo):
    text, width, max_tokens, lp = CASES[case]
    prompt = demo.tokenizer.encode(text)
    events = []
    params = SamplingParams(beam_width=width, n=width, length_penalty=lp)
    run_engine(demo, CONFIG, [("b", 0, prompt, max_tokens)], params, events=events, replay=RunState())
    expected = brute_force_beam_search(demo.model, prompt, width, max_tokens, demo.tokenizer.eos_token_ids, lp)
    outputs = finished_events(events)["b"]["outputs"]
    assert [o["output_token_ids"] for o in outputs] == [tokens for tokens, _ in expected[:width]]
    for o, (_, cum) in zip(outputs, expected, strict=False):
        assert o["cumulative_logprob"] == pytest.approx(cum, abs=1e-4)


def test_beam_search_forks_and_prunes_with_block_events(demo):
    events, state = [], RunState()
    prompt = demo.tokenizer.encode("JULIET:\nGood night, good night! parting is such sweet sorrow")
    engine = run_engine(demo, EngineConfig(block_size=2, num_blocks=300), [("b", 0, prompt, 8)],
                        SamplingParams(beam_width=3, length_penalty=1.0), events=events, replay=state)
    kinds = Counter(e["type"] for e in events)
    assert kinds["seq_fork"] >= 2 and any(e["reason"] == "pruned" for e in events if e["type"] == "seq_end")
    assert any(e["type"] == "block_share" and e["reason"] == "fork" for e in events)
    pruned = {e["seq_id"] for e in events if e["type"] == "seq_end" and e["reason"] == "pruned"}
    freed = {e["seq_id"] for e in events if e["type"] == "block_free"}
    assert pruned <= freed, "a pruned beam gives its blocks back"
    assert len(finished_events(events)["b"]["outputs"]) == 1  # n = 1: only the best
    assert all(not engine.blocks.block_table(s.seq_id) for s in engine.live_sequences())


def test_beam_search_in_a_busy_batch_with_preemption(demo):
    """Beams wait for their siblings when some were preempted; results are still the brute force's."""
    text, width, max_tokens, lp = CASES[1]
    prompt = demo.tokenizer.encode(text)
    work = [("b", 1, prompt, max_tokens)] + mixed_workload(demo, count=8, seed=11)
    engine = run_engine(demo, EngineConfig(block_size=4, num_blocks=36, max_num_batched_tokens=48), work,
                        lambda rid: SamplingParams(beam_width=width, n=width, length_penalty=lp) if rid == "b"
                        else GREEDY)
    assert engine.scheduler.num_preemptions > 0
    expected = brute_force_beam_search(demo.model, prompt, width, max_tokens, demo.tokenizer.eos_token_ids, lp)
    beam = engine.requests["b"].beam
    assert [h.output_token_ids for h in beam.ranked()[:width]] == [t for t, _ in expected[:width]]


def test_bad_multi_sequence_settings_are_refused(demo):
    engine = Engine(demo, EngineConfig(speculative={"method": "ngram", "num_tokens": 2}))
    with pytest.raises(RequestError, match="sampling.beam_width"):
        engine.add_request("a", [1, 2, 3], 4, {"beam_width": 2})
    with pytest.raises(RequestError, match="sampling.n"):
        Engine(demo, CONFIG).add_request("a", [1, 2, 3], 4, {"beam_width": 2, "n": 3})


def test_select_counts_an_eos_only_among_the_top_width():
    # Two beams, vocab 4, EOS = 0. Ranked: (b0,1) -1.0, (b0,EOS) -1.1, (b1,EOS) -1.2, (b1,2) -1.3, ...
    logprobs = torch.log(torch.tensor([[0.3329, 0.3679, 0.1, 0.1], [0.3012, 0.01, 0.2725, 0.01]]))
    top = logprobs.topk(3)  # width + one EOS per beam: what a beam row's candidates hold
    logprobs = [list(zip(i.tolist(), v.tolist())) for i, v in zip(top.indices, top.values)]
    beams, finishing = select([0.0, 0.0], logprobs, 2, [0], allow_eos=True)
    assert [(c.parent, c.token_id) for c in finishing] == [(0, 0)]  # (b1, EOS) ranks 3rd of width 2
    assert [(c.parent, c.token_id) for c in beams] == [(0, 1), (1, 2)]
    beams, finishing = select([0.0, 0.0], logprobs, 2, [0], allow_eos=False)
    assert not finishing and [(c.parent, c.token_id) for c in beams] == [(0, 1), (0, 0)]


@pytest.mark.parametrize("sampling", [{"temperature": 1.0, "seed": 2, "n": 3}, {"beam_width": 3, "n": 2}])
def test_aborting_a_multi_sequence_request_ends_every_sequence(demo, sampling):
    events = []
    engine = Engine(demo, CONFIG)
    engine.bus.subscribe(events.append)
    engine.add_request("m", demo.tokenizer.encode("BRUTUS:\nHe is gone, and"), 30, sampling)
    engine.add_request("other", demo.tokenizer.encode("CASSIUS:\nWell,"), 6, {"temperature": 0})
    for _ in range(4):
        engine.step()
    live = [s.seq_id for s in engine.requests["m"].seqs if s.seq_id in engine.scheduler.live]
    assert len(live) > 1
    engine.abort("m")
    done = finished_events(events)["m"]
    assert done["finish_reason"] == "abort" and done["reason"] == "aborted by the user" and done["outputs"]
    assert {e["seq_id"] for e in events if e["type"] == "seq_end" and e["reason"] == "abort"} == set(live)
    while engine.has_unfinished():
        engine.step()
    assert finished_events(events)["other"]["finish_reason"] in ("eos", "length")
    assert all(not engine.blocks.block_table(s.seq_id) for s in engine.requests["m"].seqs)
    engine.blocks.check_invariants(engine.live_sequences())
