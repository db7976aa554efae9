"""The sampler's stages recomputed from a token event's `dist.top`, for the sampling view.

A token event carries only the top tokens' raw (T=1) probabilities, not the whole vocabulary, so
the rest of the vocabulary is modelled as one "tail" bucket: its mass is what the shown tokens leave
over, spread over tokens no more likely than the least likely shown one (an upper bound on each). The
rules are those of `backend/engine/sampler.py` (`truncation_mask`): temperature, then top-k (ties
with the k-th token kept), then top-p judged on the top-k survivors renormalized, then min-p, the
most likely token always kept, EOS protected unless `truncate_eos`. We reimplement them over a list
instead of importing the sampler because the sampler works on torch tensors of the full vocabulary
(and importing torch costs the dashboard seconds); tests check both agree when the whole vocabulary is shown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STAGES = ("raw", "temperature", "top_k", "top_p", "min_p")
STAGE_LABELS = {
    "raw": "raw (T = 1)",
    "temperature": "after temperature",
    "top_k": "after top-k",
    "top_p": "after top-p",
    "min_p": "after min-p = final",
}


@dataclass
class Knobs:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    truncate_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Stages:
    """Probabilities per stage for the shown tokens (same order as `token_ids`) and the tail."""

    token_ids: list[int]
    texts: list[str]
    probs: dict[str, list[float]] = field(default_factory=dict)
    tail: dict[str, float] = field(default_factory=dict)  # mass of all tokens not shown, per stage
    tail_count: int = 0  # how many vocabulary tokens the tail stands for (estimate)


def compute_stages(top: list[list], knobs: Knobs, eos_ids: set[int], vocab_size: int) -> Stages:
    """Each stage's distribution over the shown tokens (sorted by raw probability) plus the tail."""
    rows = sorted(top, key=lambda r: -r[2])
    ids, texts, raw = [r[0] for r in rows], [r[1] for r in rows], [max(float(r[2]), 0.0) for r in rows]
    tail_mass = max(0.0, 1.0 - sum(raw))
    floor = min((p for p in raw if p > 0), default=1.0)
    tail_count = min(max(vocab_size - len(raw), 0), math.ceil(tail_mass / floor)) if tail_mass > 1e-9 else 0
    tail_each = tail_mass / tail_count if tail_count else 0.0
    out = Stages(ids, texts, tail_count=tail_count)
    out.probs["raw"], out.tail["raw"] = raw, tail_mass
    if knobs.greedy:  # one-hot on the argmax at every later stage
        one_hot = [1.0 if i == 0 else 0.0 for i in range(len(raw))]
        for stage in STAGES[1:]:
            out.probs[stage], out.tail[stage] = one_hot, 0.0
        return out
    tempered, tail_t = _temper(raw, tail_each, tail_count, knobs.temperature)
    out.probs["temperature"], out.tail["temperature"] = tempered, tail_t * tail_count
    keep_k = _keep_top_k(tempered, tail_count, knobs.top_k)
    # top-p over the top-k survivors: the same rule on their mass, whatever it sums to
    after_k = [q if keep else 0.0 for q, keep in zip(tempered, keep_k[0])]
    keep_p = _keep_top_p(after_k, tail_t, keep_k[1], knobs.top_p * (sum(after_k) + tail_t * keep_k[1]))
    keep_m = _keep_min_p(tempered, tail_t, tail_count, knobs.min_p)
    protect = [i for i, t in enumerate(ids) if t in eos_ids] if not knobs.truncate_eos else []
    cumulative = (keep_k,), (keep_k, keep_p), (keep_k, keep_p, keep_m)
    for stage, masks in zip(STAGES[2:], cumulative):
        shown, tail_kept = _intersect(masks, len(raw), protect)
        out.probs[stage], out.tail[stage] = _renormalise(tempered, shown, tail_t, tail_kept)
    return out


def _temper(raw: list[float], tail_each: float, tail_count: int, temperature: float) -> tuple[list[float], float]:
    """p^(1/T), normalised over the shown tokens and the tail; returns (shown, one tail token)."""
    inv = 1.0 / temperature
    # log space: p^(1/T) underflows for small T
    logs = [inv * math.log(p) if p > 0 else -math.inf for p in raw]
    tail_log = inv * math.log(tail_each) if tail_each > 0 else -math.inf
    top = max([*logs, tail_log])
    weights = [math.exp(v - top) for v in logs]
    tail_w = math.exp(tail_log - top) if tail_count else 0.0
    total = sum(weights) + tail_w * tail_count
    return [w / total for w in weights], tail_w / total


# A mask is (shown: list[bool], tail_kept: int): the rules keep a prefix of the ranking, so the tail
# keeps its first `tail_kept` tokens.
Mask = tuple[list[bool], int]


def _keep_top_k(probs: list[float], tail_count: int, k: int) -> Mask:
    """The k most likely, and every token tied with the k-th (probs sorted, most likely first)."""
    if k <= 0:
        return [True] * len(probs), tail_count
    if k > len(probs):
        return [True] * len(probs), min(tail_count, k - len(probs))
    return [q >= probs[k - 1] for q in probs], 0


def _keep_top_p(probs: list[float], tail_each: float, tail_count: int, p: float) -> Mask:
    """Keep a token while the mass ranked before it is below p (the sampler's `mass_before < top_p`).

    p is a mass in the units of probs (top_p times the mass top-p judges)."""
    before, shown = 0.0, []
    for q in probs:
        shown.append(before < p)
        before += q
    if tail_each <= 0 or before >= p:
        return shown, 0
    return shown, min(tail_count, math.ceil((p - before) / tail_each))


def _keep_min_p(probs: list[float], tail_each: float, tail_count: int, min_p: float) -> Mask:
    threshold = min_p * max([*probs, tail_each])
    return [q >= threshold for q in probs], tail_count if tail_each >= threshold else 0


def _intersect(masks: tuple[Mask, ...], n_shown: int, protect: list[int]) -> Mask:
    shown = [all(m[0][i] for m in masks) for i in range(n_shown)]
    if shown:
        shown[0] = True  # the most likely token always survives
    for i in protect:
        shown[i] = True
    return shown, min(m[1] for m in masks)


def _renormalise(probs: list[float], shown: list[bool], tail_each: float, tail_kept: int) -> tuple[list[float], float]:
    kept = [q if keep else 0.0 for q, keep in zip(probs, shown)]
    tail = tail_each * tail_kept
    total = sum(kept) + tail
    if total <= 0:
        return kept, 0.0
    return [q / total for q in kept], tail / total


def knobs_of(dist: dict, sampling: dict | None = None) -> Knobs:
    """The knobs a token event's distribution was sampled with."""
    return Knobs(temperature=float(dist.get("temperature", 1.0)), top_k=int(dist.get("top_k", 0)),
                 top_p=float(dist.get("top_p", 1.0)), min_p=float(dist.get("min_p", 0.0)),
                 truncate_eos=bool((sampling or {}).get("truncate_eos", False)))
