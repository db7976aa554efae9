"""Speculative decoding is exact: greedy output unchanged in every mode, sampled tokens distributed as the target's.

The distribution test draws 20,000 requests' tokens through the speculative engine and through the
plain engine (the target sampling directly) and compares them with a chi-square test of
homogeneity; the same test on an always-accept rule must fail, which shows it has power.
"""

import dataclasses
from collections import Counter
from collections.abc import Callable

import pytest
import torch

import kvscope.backend.engine.engine as engine_module
import kvscope.backend.engine.sample_step as sample_step
from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.rejection import Verdict, verify
from kvscope.backend.engine.sampler import draw
from kvscope.backend.engine.speculative import lookup
from kvscope.backend.events.schema import parse_event
from kvscope.backend.events.state import RunState
from kvscope.backend.engine.reference import reference_generate
from tests.engine_helpers import GREEDY, mixed_workload, outputs, run_engine

DRAFT = {"method": "draft", "draft_model": "demo-draft", "num_tokens": 4}
NGRAM = {"method": "ngram", "num_tokens": 3}

MODES = {
    "draft-k4": dict(speculative=DRAFT),
    "draft-k1-block-1": dict(speculative={**DRAFT, "num_tokens": 1}, block_size=1, num_blocks=2048),
    "draft-k8-block-3": dict(speculative={**DRAFT, "num_tokens": 8}, block_size=3, num_blocks=900),
    "draft-chunked-budget-9": dict(speculative=DRAFT, max_num_batched_tokens=9),
    "draft-preemption": dict(speculative=DRAFT, block_size=4, num_blocks=40, max_num_batched_tokens=64),
    "draft-static-contiguous": dict(speculative=DRAFT, batching="static", kv_layout="contiguous",
                                    max_model_len=128, num_blocks=256),
    "draft-no-prefix-caching": dict(speculative=DRAFT, prefix_caching=False),
    "ngram-k3": dict(speculative=NGRAM, block_size=4, num_blocks=400),
    "ngram-preemption": dict(speculative=NGRAM, block_size=4, num_blocks=30, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_speculative_equals_reference(mode, demo, draft, workload, expected):
    state, events = RunState(), []
    config = EngineConfig(**MODES[mode])
    engine = run_engine(demo, config, workload, replay=state, events=events, draft_model=draft)
    assert outputs(engine) == expected
    verifies = [e for e in events if e["type"] == "spec_verify"]
    assert verifies, "the mode must really speculate"
    assert any(e["num_accepted"] > 0 for e in verifies) and any(e["resampled_token_id"] is not None for e in verifies)
    if "preemption" in mode:
        assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_used_blocks == 0 or config.prefix_caching  # only cached blocks may stay
    assert all(not engine.blocks.block_table(s.seq_id) for s in engine.live_sequences())


def test_speculative_events_follow_the_schema(demo, draft, workload):
    events = []
    run_engine(demo, EngineConfig(speculative=DRAFT, block_size=4, num_blocks=400), workload[:6], events=events,
               draft_model=draft)
    for e in events:
        parse_event(e)
    header = events[0]
    assert header["draft_model"]["name"] == "demo-draft" and header["config"]["speculative"]["num_tokens"] == 4
    proposes = [e for e in events if e["type"] == "spec_propose"]
    draft_seqs = {e["draft_seq_id"] for e in proposes}
    # The draft model's blocks come from the same pool, under its own sequence ids.
    assert draft_seqs and draft_seqs <= {e["seq_id"] for e in events if e["type"] == "block_alloc"}
    verify_batches = [b for e in events if e["type"] == "iteration" for b in e["batch"] if b["phase"] == "verify"]
    assert verify_batches and all(b["num_query_tokens"] == 1 + b["num_draft_tokens"] for b in verify_batches)
    assert any(e["type"] == "attention_mask" and e["kind"] == "verify" for e in events)
    sources = Counter(e["source"] for e in events if e["type"] == "token")
    assert {"target", "draft_accepted", "resampled", "bonus"} <= set(sources)
    verifies = [e for e in events if e["type"] == "spec_verify"]
    for v in verifies:
        assert len(v["dists"]) == len(v["results"]) + 1 and len(v["expected_accept"]) == len(v["results"])
        accepted = [r["accepted"] for r in v["results"]]
        assert accepted == [True] * v["num_accepted"] + [False] * (len(accepted) - v["num_accepted"])
        assert (v["bonus_token_id"] is None) == (v["num_accepted"] < len(accepted))
    metrics = [e for e in events if e["type"] == "metrics"][-1]
    assert 0 < metrics["spec_acceptance_rate"] < 1 and 1 < metrics["spec_tokens_per_verify"] <= 5


def test_rolled_back_blocks_are_freed_with_events(demo, draft):
    """A rejected draft that had crossed into a new block gives that block back, in both caches."""
    events = []
    prompt = demo.tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks?")
    run_engine(demo, EngineConfig(speculative={**DRAFT, "num_tokens": 8}, block_size=2, num_blocks=300),
               [("a", 0, prompt, 40)], GREEDY.model_copy(update={"ignore_eos": True}), events=events,
               draft_model=draft)
    freed_mid_run = [e for e in events if e["type"] == "block_free" and e["step"] < events[-1]["step"] - 1]
    draft_seq = next(e["draft_seq_id"] for e in events if e["type"] == "spec_propose")
    assert {e["seq_id"] for e in freed_mid_run} >= {0, draft_seq}


def test_bad_speculative_config_is_refused(demo, tiny):
    with pytest.raises(RequestError, match="engine.speculative.draft_model"):
        engine_module.Engine(demo, EngineConfig(speculative={**DRAFT, "draft_model": "no-such-model"}))
    other_vocab = dataclasses.replace(tiny, config=tiny.config.model_copy(update={"vocab_size": 1000}))
    with pytest.raises(RequestError, match="vocabulary"):
        engine_module.Engine(demo, EngineConfig(speculative=DRAFT), draft=other_vocab)
    with pytest.raises(RequestError, match="kv_cache"):
        engine_module.Engine(demo, EngineConfig(speculative=NGRAM, kv_cache=False))


def test_ngram_lookup_copies_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 1) == [7, 1]
    assert lookup([5, 6, 7], 4, 3, 1) == []
    assert lookup([4, 8, 4], 3, 3, 1) == [8, 4]


def test_verify_rule_on_known_distributions():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 1.0]])
    v = verify(p, q, [2], [0.3, 0.6], greedy=False)  # p(2) = 0: always rejected, resampled from max(0, p - q) = p
    assert v.num_accepted == 0 and v.source == "resampled" and v.token_id in (0, 1)
    always = verify(torch.tensor([[0, 1.0, 0], [1.0, 0, 0]]), torch.tensor([[0, 1.0, 0]]), [1], [], greedy=True)
    assert always == Verdict(1, 0, "bonus", [True])


# ---- the distribution test ----------------------------------------------------------------------

NUM_SAMPLES = 6_000
ENDED = -1  # the counted "token" of a position past the output's end
SETTINGS = {"T1": dict(temperature=1.0), "T0.7-top-p-0.9": dict(temperature=0.7, top_p=0.9),
            # the draft proposes from its own unmasked distribution; the target's masked p rejects what the
            # grammar forbids, and the output must still follow the masked target exactly
            "T1-grammar": dict(temperature=1.0, structured_outputs={"regex": "[a-z ]+"})}


def chi_square_pvalue(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """Two-sample chi-square test of homogeneity; bins with small expected counts are pooled."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    na, nb = sum(a.values()), sum(b.values())
    rows, pooled = [], [0, 0]
    for k in keys:
        if (a[k] + b[k]) * min(na, nb) / (na + nb) >= min_expected:
            rows.append((a[k], b[k]))
        else:
            pooled[0] += a[k]
            pooled[1] += b[k]
    if sum(pooled) * min(na, nb) / (na + nb) >= min_expected:
        rows.append(tuple(pooled))
    obs = torch.tensor(rows, dtype=torch.float64)  # [bins, 2]
    expected = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    stat = ((obs - expected) ** 2 / expected).sum()
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def sampled_tokens(demo, draft, speculative, sampling: dict) -> list[Counter]:
    """Counters of output tokens 2, 3 and 4 of NUM_SAMPLES seeded requests for one fixed prompt.

    Token 1 comes from the prefill; with k = 2 one verify drafts tokens 2 and 3 and may add a bonus
    token 4, so accepted, resampled and bonus tokens are all counted."""
    # 4m + 1 tokens: after the first batch, prefix caching leaves one prompt token to compute.
    prompt = demo.tokenizer.encode("First Citizen:\nBefore we proceed any further, hear me speak.")[:13]
    config = EngineConfig(speculative=speculative, max_num_seqs=512, max_num_batched_tokens=4096,
                          num_blocks=4096, block_size=4, events="off")
    engine = engine_module.Engine(demo, config, draft=draft)
    for i in range(NUM_SAMPLES):
        engine.add_request(f"r{i}", prompt, 4, {**sampling, "seed": i, "ignore_eos": True})
    while engine.has_unfinished():
        engine.step()
    counts = [Counter(), Counter(), Counter()]
    for req in engine.requests.values():
        tokens = req.seq.output_token_ids[1:]
        for position in range(3):  # ENDED: a grammar that accepts lets EOS end the output early
            counts[position][tokens[position] if position < len(tokens) else ENDED] += 1
    return counts


@pytest.fixture(scope="module")
def direct_samples(demo, draft) -> Callable[[str], list[Counter]]:
    """The plain engine's samples for a setting, drawn the first time a test asks (~15 s each): a setting
    only the slow run checks costs the default run nothing."""
    drawn: dict[str, list[Counter]] = {}

    def samples(name: str) -> list[Counter]:
        if name not in drawn:
            drawn[name] = sampled_tokens(demo, draft, None, SETTINGS[name])
        return drawn[name]
    return samples


# The default run checks the most general setting (temperature and top-p); the slow run every one.
@pytest.mark.parametrize("setting", [pytest.param(name, marks=[] if name == "T0.7-top-p-0.9" else pytest.mark.slow)
                                     for name in SETTINGS])
def test_speculative_sampling_has_the_target_distribution(setting, demo, draft, direct_samples):
    spec = sampled_tokens(demo, draft, {**DRAFT, "num_tokens": 2}, SETTINGS[setting])
    for position, (a, b) in enumerate(zip(spec, direct_samples(setting), strict=True)):
        assert sum(a.values()) == sum(b.values()) == NUM_SAMPLES
        assert chi_square_pvalue(a, b) > 0.01, f"output token {position + 2} differs from the target's"


@pytest.mark.slow  # the statistical test's own power, checked once it changes, not on every run (~25 s)
@pytest.mark.parametrize("setting", ["T1", "T1-grammar"])
def test_the_distribution_test_catches_a_wrong_rule(setting, demo, draft, direct_samples, monkeypatch):
    def accept_whatever_p_allows(p, q, drafts, uniforms, greedy):
        """Keeps every draft the (masked) target gives any probability: the output follows the grammar
        but leans towards the draft's distribution."""
        for j, x in enumerate(drafts):
            if p[j, x] == 0:
                token = int(draw(p[j][None], uniforms[-1:])[0])
                return Verdict(j, token, "resampled", [True] * j + [False] * (len(drafts) - j))
        return Verdict(len(drafts), int(draw(p[-1][None], uniforms[-1:])[0]), "bonus", [True] * len(drafts))

    monkeypatch.setattr(sample_step, "verify", accept_whatever_p_allows)
    spec = sampled_tokens(demo, draft, {**DRAFT, "num_tokens": 2}, SETTINGS[setting])
    assert chi_square_pvalue(spec[0], direct_samples(setting)[0]) < 0.01


@pytest.mark.parametrize("spec", [DRAFT, NGRAM])
def test_seeded_speculative_sampling_is_the_same_alone_and_in_a_crowd(demo, draft, spec):
    """Drafts draw from the request's own draft stream and verdicts from its own target stream."""
    prompt = demo.tokenizer.encode("GLOUCESTER:\nNow is the winter of our discontent")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    config = EngineConfig(speculative=spec, block_size=4, num_blocks=600)
    alone = run_engine(demo, config, [("x", 0, prompt, 24)], params, draft_model=draft)
    crowd = run_engine(demo, config, [("x", 3, prompt, 24)] + mixed_workload(demo, count=8, seed=4),
                       lambda rid: params if rid == "x" else SamplingParams(temperature=1.0, seed=int(rid[1:])),
                       draft_model=draft)
    assert alone.requests["x"].seq.output_token_ids == crowd.requests["x"].seq.output_token_ids


@pytest.mark.parametrize("spec", [None, DRAFT, NGRAM])
def test_penalties_see_the_output_so_far_with_and_without_speculation(demo, draft, spec):
    """Greedy with repetition, presence and frequency penalties equals the reference, token for token:
    each position (a verified draft's too) is penalised by exactly the output before it."""
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                            ignore_eos=True)
    work = [(f"p{i}", i, demo.tokenizer.encode(text), 24) for i, text in
            enumerate(["ROMEO:\nAnd I will", "JULIET:\nO Romeo, Romeo", "KING:\nWe will, we will"])]
    engine = run_engine(demo, EngineConfig(speculative=spec, block_size=4, num_blocks=400), work, params,
                        draft_model=draft)
    for rid, _, prompt, max_tokens in work:
        assert engine.requests[rid].seq.output_token_ids == reference_generate(
            demo.model, prompt, max_tokens, params, demo.tokenizer.eos_token_ids)


# ---- the draft model's blocks go through the scheduler --------------------------------------------


def draft_scheduler(num_blocks: int, tokenizer):
    """A scheduler over a tiny pool, and a maker of target sequences whose draft-model sequences (namespace 1)
    have computed the target's tokens, as the scheduler's draft pass leaves them."""
    from kvscope.backend.engine.scheduler import Scheduler
    from kvscope.backend.engine.sequence import Sequence

    scheduler = Scheduler(EngineConfig(block_size=4, num_blocks=num_blocks, speculative=DRAFT), num_blocks, tokenizer)

    def computed_draft(seq_id: int, tokens: list[int]) -> tuple[Sequence, Sequence]:
        target = Sequence(seq_id, f"r{seq_id}", list(tokens), len(tokens))
        shadow = scheduler._sync_shadow(target)
        scheduler._reserve_draft(shadow, len(shadow) - shadow.num_computed_tokens, 0)
        scheduler._computed(shadow, len(tokens))
        return target, shadow

    return scheduler, computed_draft


def test_a_draft_that_rewrites_a_block_another_draft_shares_gets_a_copy(demo):
    scheduler, computed_draft = draft_scheduler(8, demo.tokenizer)
    table = scheduler.blocks.block_table
    target, a = computed_draft(0, list(range(8)))  # blocks 0 and 1, both full and cached
    _, b = computed_draft(1, list(range(8)) + [50, 51])  # shares both, computes its tail in a third block
    assert table(a.seq_id) == [0, 1] and table(b.seq_id)[:2] == [0, 1] and b.num_computed_tokens == 10
    target.token_ids[6:] = [70, 71]  # the target rejected its drafts: its draft sequence rolls back into block 1
    assert scheduler._sync_shadow(target) is a
    assert a.num_computed_tokens == 6 and a.token_ids == list(range(6)) + [70, 71]
    copies = scheduler._reserve_draft(a, 2, 0)
    assert copies == [(1, table(a.seq_id)[1])] and table(a.seq_id)[1] != 1  # b keeps block 1 as it was
    assert table(b.seq_id)[:2] == [0, 1]


def test_a_draft_never_takes_the_blocks_the_running_sequences_need_next(demo):
    scheduler, computed_draft = draft_scheduler(4, demo.tokenizer)
    _, a = computed_draft(0, list(range(7)))  # two blocks; two free
    assert scheduler._reserve_draft(a, 2, keep_free=2) is None  # its ninth slot needs a third block
    assert scheduler.blocks.block_table(a.seq_id) == [0, 1] and scheduler.blocks.num_free_blocks == 2  # unchanged
    assert scheduler._reserve_draft(a, 2, keep_free=1) == [] and scheduler.blocks.num_blocks_of(a.seq_id) == 3
