"""The sampler: each filter does what its name says, EOS survives truncation, seeds are per row."""

import pytest
import torch

from kvscope.backend.engine.sampler import apply_penalties, final_distribution, sample, truncation_mask, uniform
from kvscope.backend.engine.sampling_params import SamplingParams

EOS = 0
# token:           0(EOS) 1     2     3     4     5
PROBS = torch.tensor([0.02, 0.40, 0.30, 0.15, 0.08, 0.05])
LOGITS = PROBS.log()[None]


def final(**kw) -> list[float]:
    return [round(p, 4) for p in final_distribution(LOGITS, [SamplingParams(**kw)], [EOS])[0].tolist()]


def kept(**kw) -> set[int]:
    return {i for i, p in enumerate(final(**kw)) if p > 0}


def test_top_k_keeps_the_k_most_likely_and_eos():
    assert kept(top_k=2) == {1, 2, EOS}


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(top_p=0.7) == {1, 2, EOS}  # 0.40 + 0.30 reaches 0.7
    assert kept(top_p=0.71) == {1, 2, 3, EOS}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    assert kept(min_p=0.3) == {1, 2, 3, EOS}  # 0.3 x 0.40 = 0.12


def test_eos_can_be_truncated_when_asked():
    assert kept(top_k=2, truncate_eos=True) == {1, 2}


def test_truncated_distribution_is_renormalised():
    p = final(top_k=2, truncate_eos=True)
    assert p[1] == pytest.approx(0.40 / 0.70, abs=1e-4) and sum(p) == pytest.approx(1.0)


def test_temperature_sharpens_and_flattens():
    cold, hot = final(temperature=0.5), final(temperature=2.0)
    assert cold[1] > 0.40 > hot[1]


def test_greedy_is_one_hot_on_the_argmax():
    assert final(temperature=0.0) == [0, 1, 0, 0, 0, 0]


def test_truncation_mask_always_keeps_the_most_likely_token():
    mask = truncation_mask(PROBS[None], torch.tensor([0]), torch.tensor([1e-9]), torch.tensor([1.0]))
    assert mask[0].tolist() == [False, True, False, False, False, False]


def test_repetition_presence_and_frequency_penalties():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    rep = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1]], [[]])
    assert rep[0].tolist() == [1.0, -2.0, 3.0, 0.5]
    pf = apply_penalties(logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [[]], [[2, 2, 3]])
    assert pf[0].tolist() == [2.0, -1.0, 3.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]


def test_each_row_draws_from_its_own_generator():
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0)
    alone = [sample(logits, [params], [uniform(torch.Generator().manual_seed(s))], [EOS]).token_ids[0] for s in range(20)]
    batch = sample(logits.expand(20, 50), [params] * 20, [uniform(torch.Generator().manual_seed(s)) for s in range(20)], [EOS])
    assert batch.token_ids == alone and len(set(alone)) > 1


def test_sampling_follows_the_final_distribution():
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=3)
    draws = [sample(LOGITS, [params], [uniform(gen)], [EOS]).token_ids[0] for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=6).float() / len(draws)
    expected = torch.tensor(final(top_k=3))
    assert freq[4] == 0 and freq[5] == 0
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)


def test_logprob_is_of_the_raw_distribution():
    out = sample(LOGITS, [SamplingParams(temperature=0.0)], [0.0], [EOS])
    assert out.token_ids == [1] and out.logprobs[0] == pytest.approx(float(PROBS[1].log()), abs=1e-5)


# ---- the order of the filters, as transformers and vLLM chain them --------------------------------------

def test_top_p_is_judged_on_the_top_k_survivors_renormalised():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()  # no EOS among them: eos_ids is empty
    out = final_distribution(logits, [SamplingParams(top_k=2, top_p=0.6)], [])
    assert out[0].tolist() == [1.0, 0.0, 0.0]  # 0.5 / 0.8 = 0.625 >= 0.6: the second token is not needed


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.2]]).log()
    kept_ids = final_distribution(logits, [SamplingParams(top_k=2)], [])[0] > 0
    assert kept_ids.tolist() == [True, True, True, True]
    kept_ids = final_distribution(torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log(), [SamplingParams(top_k=2)], [])[0] > 0
    assert kept_ids.tolist() == [True, True, False, False]


def test_eos_exemption_adds_eos_back_after_the_filters():
    logits = torch.tensor([[0.05, 0.5, 0.3, 0.15]]).log()  # token 0 is EOS
    out = final_distribution(logits, [SamplingParams(top_k=1)], [EOS])[0]
    assert out.tolist() == pytest.approx([0.05 / 0.55, 0.5 / 0.55, 0.0, 0.0])
    assert final_distribution(logits, [SamplingParams(top_k=1, truncate_eos=True)], [EOS])[0].tolist() == [0, 1, 0, 0]


def test_filters_match_transformers_logits_warpers_on_random_distributions():
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        vocab = int(torch.randint(2, 60, (1,), generator=gen))
        logits = torch.randn(1, vocab, generator=gen) * float(torch.rand((), generator=gen) * 4 + 0.1)
        t = float(torch.rand((), generator=gen) * 1.9 + 0.1)
        k = int(torch.randint(0, vocab + 2, (1,), generator=gen))
        p = float(torch.rand((), generator=gen) * 0.99 + 0.01) if torch.rand((), generator=gen) < 0.8 else 1.0
        m = float(torch.rand((), generator=gen) * 0.5) if torch.rand((), generator=gen) < 0.5 else 0.0
        warpers = [transformers.TemperatureLogitsWarper(t)] + ([transformers.TopKLogitsWarper(k)] if k else []) \
            + [transformers.TopPLogitsWarper(p), transformers.MinPLogitsWarper(m)]
        scores = logits.clone()
        for w in warpers:
            scores = w(None, scores)
        theirs = torch.softmax(scores, dim=-1)
        ours = final_distribution(logits, [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)], [])
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0, msg=f"T={t} k={k} p={p} min_p={m}")


# ---- logit_bias and allowed_token_ids ------------------------------------------------------------------

def test_logit_bias_shifts_the_raw_distribution_before_the_filters():
    out = sample(LOGITS, [SamplingParams(temperature=0.0, logit_bias={3: 2.0})], [0.0], [EOS])
    assert out.token_ids == [3]  # log 0.15 + 2 > log 0.40
    biased = PROBS.log().clone()
    biased[3] += 2.0
    torch.testing.assert_close(out.raw_probs[0], torch.softmax(biased, -1))
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(biased, -1)[3]), abs=1e-5)


def test_allowed_token_ids_leave_only_those_tokens():
    params = SamplingParams(allowed_token_ids=[3, 4], truncate_eos=True)
    out = sample(LOGITS.expand(50, -1), [params] * 50, [uniform(torch.Generator().manual_seed(s)) for s in range(50)], [EOS])
    assert set(out.token_ids) == {3, 4}
    assert out.raw_probs[0, [3, 4]].sum() == pytest.approx(1.0)


def test_constraints_touch_only_their_own_row():
    params = [SamplingParams(logit_bias={5: -100.0}), SamplingParams()]
    out = sample(LOGITS.expand(2, -1), params, [0.0, 0.0], [EOS])
    assert out.raw_probs[0, 5] < 1e-30 and out.raw_probs[1, 5] == pytest.approx(0.05)
