"""The sampler's stages recomputed for the sampling view, exactly or from a token event's top tokens.

Exact: given the token's whole raw (T=1) distribution, every stage is computed over the full
vocabulary. The row comes from the token event itself when the run recorded it there
(`dist.raw_probs_f32`: each sequence's first token, a grammar's forced ones; so a saved run and a
replay are as exact as the live run for them), else from a served run that still keeps it (GET
/api/runs/{id}/dist); and under a grammar that allowed no more tokens than the event shows, the
shown ones are the whole distribution. Approximate otherwise (a replay's other tokens, an evicted
row): the rest of the vocabulary is modelled as tokens no more likely than the least likely shown
one (an upper bound on each), as many as the left over mass needs. What the view prints as fact
is never modelled: the vocabulary's size, how many tokens are not shown, the mass they hold
(1 - the shown ones' sum). Either way the shown tokens are reported one by one and everything else
as one "tail" bucket. Under a grammar (structured outputs) the event's raw distribution is the one
after the grammar's mask; the model's own comes first as the "model" stage, rebuilt from the mass
the mask removed and the likeliest tokens it removed (the event's `dist.masked`). The rules are those
of `backend/engine/sampler.py` (`truncation_mask`): temperature, then top-k (ties with the k-th
token kept), then top-p judged on the top-k survivors renormalized, then min-p, the most likely
token always kept, EOS protected unless `truncate_eos`. We reimplement them with numpy instead of
importing the sampler because importing torch costs the dashboard seconds (tests/test_imports.py
holds the dashboard to no torch); tests check both agree to 1e-6.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field

import numpy as np

STAGES = ("raw", "temperature", "top_k", "top_p", "min_p")
GRAMMAR_STAGES = ("model", "masked", *STAGES[1:])  # under a grammar: the model's own, then after its mask
STAGE_LABELS = {
    "model": "model (T = 1)",
    "masked": "after the grammar's mask",
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
class Mask:
    """What a grammar's mask did to a token's distribution (a token event's masked_mass and dist.masked)."""

    mass: float  # the model's probability on the tokens it removed
    top: list[list]  # [token_id, text, the model's p] of the likeliest removed tokens
    num_allowed: int


@dataclass
class Stages:
    """Probabilities per stage for the shown tokens (same order as `token_ids`) and the tail."""

    token_ids: list[int]
    texts: list[str]
    names: tuple[str, ...] = STAGES  # the stages, in order (GRAMMAR_STAGES under a grammar)
    mask: Mask | None = None  # the grammar's, when one constrains the token
    masked: set[int] = field(default_factory=set)  # shown tokens the grammar's mask removed
    probs: dict[str, list[float]] = field(default_factory=dict)
    tail: dict[str, float] = field(default_factory=dict)  # mass of all tokens not shown, per stage
    tail_count: int = 0  # how many vocabulary tokens are not shown (a fact, exact or not)
    removed: dict[str, float] = field(default_factory=dict)  # per filter: share of the mass it was given that it cut
    exact: bool = False  # computed from the whole distribution, not the tail model


def compute_stages(top: list[list], knobs: Knobs, eos_ids: set[int], vocab_size: int,
                   row: np.ndarray | None = None, mask: Mask | None = None) -> Stages:
    """Each stage's distribution over the shown tokens (sorted by raw probability; under a grammar by
    the model's, its masked tokens among them) plus the tail.

    row: the whole raw distribution [vocab] (exact); None: the tail model (approximate), unless the
    top holds every token a grammar allowed (then it is the whole distribution)."""
    rows = sorted(top, key=lambda r: -r[2])
    if mask is not None:  # a masked token has no raw (after the mask) probability: 0 among the rows
        model_p = {int(r[0]): float(r[2]) * (1.0 - mask.mass) for r in rows}
        rows += [[t, text, 0.0] for t, text, _ in mask.top if int(t) not in model_p]
        model_p |= {int(t): float(p) for t, _, p in mask.top}
        rows.sort(key=lambda r: -model_p[int(r[0])])
    ids, texts = [int(r[0]) for r in rows], [r[1] for r in rows]
    if row is None and mask is not None and whole_under_mask(rows, mask, vocab_size):
        row = np.zeros(vocab_size)
        row[ids] = [float(r[2]) for r in rows]
    if row is not None:
        full, shown = np.asarray(row, dtype=np.float64), np.array(ids, dtype=np.int64)
        eos = [i for i in eos_ids if 0 <= i < len(row)]
    else:
        full = _modelled_row([max(float(r[2]), 0.0) for r in rows], vocab_size)
        shown, eos = np.arange(len(ids)), [i for i, t in enumerate(ids) if t in eos_ids]
    tail_count = max(vocab_size - len(ids), 0)
    probs, removed = stage_probs(full, knobs, [] if knobs.truncate_eos else eos)
    out = Stages(ids, texts, tail_count=tail_count, removed=removed, exact=row is not None)
    for stage, p in probs.items():
        picked = p[shown]
        out.probs[stage] = picked.tolist()
        out.tail[stage] = max(0.0, float(p.sum() - picked.sum()))
    if mask is not None:
        _model_stage(out, rows, mask)
    return out


def _model_stage(out: Stages, rows: list[list], mask: Mask) -> None:
    """The model's own distribution before the grammar's mask, over the shown tokens and the tail: an
    allowed token's is its raw p scaled back by the mass the mask kept; a masked one's is on record
    (an EOS row the mask removed but too unlikely to be on record: 0). The raw stage (the event's,
    after the mask) is renamed "masked"."""
    model_p = {int(t): float(p) for t, _, p in mask.top}
    out.masked = {int(r[0]) for r in rows if float(r[2]) == 0.0}  # no softmax gives 0: only the mask does
    out.probs["masked"], out.tail["masked"] = out.probs.pop("raw"), out.tail.pop("raw")
    kept = 1.0 - mask.mass
    out.probs["model"] = [model_p.get(t, 0.0) if t in out.masked else p * kept
                          for t, p in zip(out.token_ids, out.probs["masked"], strict=True)]
    out.tail["model"] = max(0.0, 1.0 - sum(out.probs["model"]))
    out.removed["masked"] = mask.mass  # named on the stage after the cut, as each filter's is
    out.names, out.mask = GRAMMAR_STAGES, mask


def whole_under_mask(rows: list[list], mask: Mask, vocab_size: int) -> bool:
    """Whether the shown tokens are every one the grammar allowed (as many with a probability as it
    allowed): then they are the whole distribution after the mask, and every later stage is exact."""
    allowed = {int(r[0]) for r in rows if float(r[2]) > 0.0}
    return 0 < mask.num_allowed == len(allowed) and max(allowed) < vocab_size


def _modelled_row(raw: list[float], vocab_size: int) -> np.ndarray:
    """The shown tokens' raw probabilities followed by the tail model: as many tokens as the left over
    mass needs, each as likely as the least likely shown one (never more than the vocabulary has)."""
    tail_mass = max(0.0, 1.0 - sum(raw))
    floor = min((p for p in raw if p > 0), default=1.0)
    count = min(max(vocab_size - len(raw), 0), math.ceil(tail_mass / floor)) if tail_mass > 1e-9 else 0
    return np.array(raw + [tail_mass / count if count else 0.0] * count, dtype=np.float64)


def stage_probs(raw: np.ndarray, knobs: Knobs, protect: list[int]) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Every stage over the whole distribution raw [V] (protect: EOS indices that survive the cuts);
    and per filter the share of the mass entering it that it removed."""
    out = {"raw": raw}
    if knobs.greedy:  # one-hot on the argmax at every later stage
        one_hot = np.zeros_like(raw)
        one_hot[int(raw.argmax())] = 1.0
        return out | {stage: one_hot for stage in STAGES[1:]}, {}
    with np.errstate(divide="ignore"):
        logs = np.log(raw) / knobs.temperature  # log space: p^(1/T) underflows for small T
    tempered = np.exp(logs - logs.max())
    tempered /= tempered.sum()
    out["temperature"] = tempered
    removed, kept_before = {}, 1.0
    for stage, keep in zip(STAGES[2:], _cumulative_masks(tempered, knobs, protect)):
        kept = np.where(keep, tempered, 0.0)
        mass = float(kept.sum())
        out[stage] = kept / mass
        removed[stage] = 1.0 - mass / kept_before
        kept_before = mass
    return out, removed


def _cumulative_masks(probs: np.ndarray, knobs: Knobs, protect: list[int]) -> list[np.ndarray]:
    """Which tokens survive top-k, then also top-p, then also min-p: the sampler's truncation_mask."""
    order = np.argsort(-probs, kind="stable")
    ranked = probs[order]
    k = min(max(knobs.top_k, 1), len(ranked))
    keep_k = ranked >= ranked[k - 1] if knobs.top_k > 0 else np.ones(len(ranked), dtype=bool)
    survivors = np.where(keep_k, ranked, 0.0)
    mass_before = np.cumsum(survivors) - survivors
    keep_p = keep_k & (mass_before < knobs.top_p * survivors.sum())
    keep_m = keep_p & (ranked >= knobs.min_p * ranked[0])
    masks = []
    for ranked_keep in (keep_k, keep_p, keep_m):
        keep = np.zeros(len(probs), dtype=bool)
        keep[order] = ranked_keep
        keep[order[0]] = True  # the most likely token always survives
        keep[protect] = True
        masks.append(keep)
    return masks


def decode_row(raw_probs_f32: str) -> np.ndarray:
    """A row as the dist route and a recorded token event carry it (base64 of little-endian float32) as float64 [V]."""
    return np.frombuffer(base64.b64decode(raw_probs_f32), dtype="<f4").astype(np.float64)


def recorded_row(dist: dict) -> np.ndarray | None:
    """The whole raw row a token event carries when its run recorded it (dist_rows.py RecordedRows)."""
    text = dist.get("raw_probs_f32")
    return decode_row(text) if text else None


def knobs_of(dist: dict, sampling: dict | None = None) -> Knobs:
    """The knobs a token event's distribution was sampled with."""
    return Knobs(temperature=float(dist.get("temperature", 1.0)), top_k=int(dist.get("top_k", 0)),
                 top_p=float(dist.get("top_p", 1.0)), min_p=float(dist.get("min_p", 0.0)),
                 truncate_eos=bool((sampling or {}).get("truncate_eos", False)))
