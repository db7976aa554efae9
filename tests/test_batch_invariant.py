"""engine.batch_invariant: a request's tokens and log-probabilities, bit for bit, whatever else is in its
batch or its cache (docs/engine.md#batch-invariant-mode).

The request served alone is the reference; the property test serves it again among 0-64 others, arriving
later, chunked, after a prefix-cache hit, preempted for lack of blocks, and compares the bits. The default
mode is the control: the same crowd changes its log-probabilities there, so the test can fail.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.model.loader import LoadedModel
from kvscope.backend.scenario import draw_prompt
from tests.engine_helpers import GREEDY, run_engine

SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
TOKENS = 12


def target_prompt(loaded: LoadedModel) -> list[int]:
    return draw_prompt(loaded.tokenizer, 37, random.Random(3))


def served(loaded: LoadedModel, config: EngineConfig, others: list[tuple[str, int, list[int], int]],
           at: int = 0, sampling: SamplingParams = GREEDY, first: list[int] | None = None):
    """The target's (token, logprob) pairs, its engine and the run's events, served with `others`; `first`: a
    prompt served to the end before the target arrives (its blocks stay in the prefix cache)."""
    prompt, events = target_prompt(loaded), []
    work = [("target", at, prompt, TOKENS), *others]
    if first is not None:
        work = [("first", 0, first, 2), *[(rid, step + 40, p, n) for rid, step, p, n in work]]
    engine = run_engine(loaded, config, work, events=events,
                        sampling=lambda rid: sampling if rid == "target" else GREEDY)
    got = [(e["token_id"], e["logprob"]) for e in events if e["type"] == "token" and e["request_id"] == "target"]
    assert len(got) == TOKENS
    return got, engine, events


def crowd(loaded: LoadedModel, size: int, seed: int) -> list[tuple[str, int, list[int], int]]:
    rng = random.Random(seed)
    return [(f"o{i}", rng.randrange(0, 6), draw_prompt(loaded.tokenizer, rng.randrange(1, 40), rng),
             rng.randrange(1, 12)) for i in range(size)]


INVARIANT = dict(batch_invariant=True, events="summary")


@pytest.fixture(scope="module")
def alone(tiny: LoadedModel):
    """The target served alone, greedy or seeded, by an engine of this block size: the bits every placement must
    reproduce. The block size is the engine's, not the placement's: attention sums over whole blocks, masked."""
    done: dict[tuple[str, int], list] = {}

    def bits(sampling: str = "greedy", block_size: int = 16) -> list:
        if (sampling, block_size) not in done:
            params = SEEDED if sampling == "seeded" else GREEDY
            done[sampling, block_size] = served(tiny, EngineConfig(**INVARIANT, block_size=block_size), [],
                                                sampling=params)[0]
        return done[sampling, block_size]
    return bits


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 64), seed=st.integers(0, 10_000), at=st.integers(0, 4),
       budget=st.sampled_from([5, 16, 64, 512]), block_size=st.sampled_from([2, 4, 16]),
       scarce=st.booleans(), cached=st.sampled_from([None, "same", "prefix"]), sampling=st.sampled_from(["greedy", "seeded"]))
def test_a_request_has_the_same_bits_alone_and_in_any_placement(tiny: LoadedModel, alone, size: int, seed: int,
                                                                 at: int, budget: int, block_size: int, scarce: bool,
                                                                 cached: str | None, sampling: str) -> None:
    # scarce: a pool of 48 tokens' blocks beyond one sequence's own, so a crowd preempts and recomputes
    blocks = (37 + TOKENS) // block_size + 1 + (48 // block_size if scarce else 4096 // block_size)
    config = EngineConfig(**INVARIANT, max_num_batched_tokens=budget, block_size=block_size, num_blocks=blocks,
                          max_num_seqs=64)
    prompt = target_prompt(tiny)
    first = {None: None, "same": prompt, "prefix": prompt[:21] + [5, 6, 7]}[cached]
    got, _, _ = served(tiny, config, crowd(tiny, size, seed), at, SEEDED if sampling == "seeded" else GREEDY, first)
    assert got == alone(sampling, block_size)  # tokens and float logprobs, compared exactly


@pytest.mark.parametrize("placement", ["chunked", "prefix-hit", "preempted", "speculative"])
def test_each_placement_really_happens_and_keeps_the_bits(tiny: LoadedModel, alone, placement: str) -> None:
    """The property test's placements, each made certain once: the engine really chunked the target's prompt,
    served it from the prefix cache, preempted it, or verified a draft model's tokens for it."""
    prompt = target_prompt(tiny)
    config = {"chunked": dict(max_num_batched_tokens=5), "prefix-hit": {},
              "preempted": dict(block_size=2, num_blocks=44, max_num_batched_tokens=64),
              "speculative": dict(speculative={"method": "draft", "draft_model": "demo-draft", "num_tokens": 3})}[placement]
    first = prompt if placement == "prefix-hit" else None
    got, engine, events = served(tiny, EngineConfig(**INVARIANT, max_num_seqs=64, **config), crowd(tiny, 24, 1),
                                 first=first)
    target = engine.requests["target"].seq
    if placement == "prefix-hit":
        assert target.num_cached_prompt_tokens >= 32
    if placement == "preempted":
        assert engine.scheduler.num_preemptions > 0
    if placement == "speculative":
        assert any(e["type"] == "spec_verify" and e["request_id"] == "target" for e in events)
    assert got == alone("greedy", config.get("block_size", 16))


def test_the_default_mode_is_not_invariant_so_the_test_can_fail(tiny: LoadedModel) -> None:
    """Without the mode the same crowd moves the target's log-probabilities in their last bits (a matmul of
    one row and of many sum in different orders): what the mode exists to remove, and the lesson shows."""
    alone_bits, _, _ = served(tiny, EngineConfig(events="summary"), [])
    crowded, _, _ = served(tiny, EngineConfig(events="summary", max_num_batched_tokens=16, max_num_seqs=64),
                        crowd(tiny, 24, 1))
    assert [t for t, _ in crowded] == [t for t, _ in alone_bits]  # the tokens agree (no near-tie here) ...
    assert [lp for _, lp in crowded] != [lp for _, lp in alone_bits]  # ... their log-probabilities do not


def test_two_ranks_keep_the_bits_of_their_own_degree(tiny: LoadedModel) -> None:
    """Tensor-parallel: each token's forward is a step of its own on every rank, and the all-reduce sums the
    ranks' partial rows in a fixed order, so the mode holds at a given degree. Across degrees it cannot: two
    ranks' halves of a sum, added, are not the one-rank sum's order (docs/engine.md#batch-invariant-mode)."""
    config = dict(**INVARIANT, tensor_parallel=2, max_num_seqs=64)
    alone_bits, first, _ = served(tiny, EngineConfig(**config), [])
    first.close()
    crowded, engine, _ = served(tiny, EngineConfig(**config, max_num_batched_tokens=16), crowd(tiny, 12, 2))
    engine.close()
    assert crowded == alone_bits



def test_the_flags_set_the_mode_and_simulate_mode_refuses_it(tmp_path, capsys, demo: LoadedModel) -> None:
    """`kvscope run --batch-invariant` writes the mode in its trace header; `generate --batch-invariant` answers
    with the greedy reference's text; simulate mode, which computes no logits, refuses it naming the field."""
    from kvscope.backend.engine.reference import reference_generate
    from kvscope.backend.events.trace import read_trace
    from kvscope.cli import main

    trace = tmp_path / "t.jsonl"
    assert main(["run", "continuous-batching", "--batch-invariant", "--trace", str(trace)]) == 0
    assert read_trace(trace)[0]["config"]["batch_invariant"] is True
    capsys.readouterr()
    assert main(["generate", "--prompt", "ROMEO:\n", "--max-tokens", "12", "--temperature", "0", "--batch-invariant"]) == 0
    expected = reference_generate(demo.model, demo.tokenizer.encode("ROMEO:\n"), 12, GREEDY, demo.tokenizer.eos_token_ids)
    assert capsys.readouterr().out == demo.tokenizer.decode([t for t in expected if t != 0]) + "\n"
    assert main(["run", "roofline", "--batch-invariant"]) == 2
    assert "engine.batch_invariant" in capsys.readouterr().err
