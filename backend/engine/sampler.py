"""From logits to tokens, vectorized over the batch.

Order of the stages (each one is a view in the dashboard's sampling panel):
the grammar's mask (structured outputs), allowed_token_ids and logit_bias -> raw softmax at T=1 ->
penalties -> temperature -> top-k -> top-p (over the top-k survivors renormalized) -> min-p -> final
distribution, the order of transformers and vLLM.
EOS survives the three filters unless the request sets `truncate_eos`.
Each row draws its uniform number from its own request's generator, so a seeded request gets the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.step_output import MaskEffect


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # log of the raw (T=1) probability of each chosen token
    raw_logprobs: torch.Tensor  # [B, V] log_softmax of the model's logits at T=1 (logprobs is a gather of it)
    final_probs: torch.Tensor  # [B, V] the distribution the token was drawn from

    @property
    def raw_probs(self) -> torch.Tensor:
        """[B, V] softmax at T=1: an exp over the whole batch on every access, so a caller reads it once."""
        return self.raw_logprobs.exp()


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                    outputs: list[list[int]]) -> torch.Tensor:
    """Repetition (over prompt + output, divides positive logits), presence and frequency (over output)."""
    logits = logits.clone()
    for row, p in enumerate(params):
        if p.repetition_penalty != 1.0 and histories[row]:
            seen = torch.tensor(sorted(set(histories[row])), device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and outputs[row]:
            ids, counts = torch.tensor(outputs[row], device=logits.device).unique(return_counts=True)
            logits[row, ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    return logits


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Which tokens survive top-k, then top-p, then min-p, as transformers and vLLM chain them: bool [B, V].

    probs [B, V] after temperature. top-k keeps every token tied with the k-th most likely (as
    transformers' TopKLogitsWarper does); top-p is judged on the top-k survivors renormalized (the
    smallest prefix holding top_p of their mass); min-p drops tokens below min_p x the most likely
    one. The most likely token always survives. One sort serves all three.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kth = sorted_probs.gather(-1, (top_k.clamp(1, probs.shape[-1]) - 1)[:, None])  # [B, 1]
    keep_sorted = (top_k[:, None] == 0) | (sorted_probs >= kth)
    survivors = torch.where(keep_sorted, sorted_probs, 0.0)
    mass_before = survivors.cumsum(dim=-1) - survivors
    keep_sorted &= mass_before < top_p[:, None] * survivors.sum(dim=-1, keepdim=True)
    keep_sorted &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def constrain(logits: torch.Tensor, params: list[SamplingParams], bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The request's own edits of the model's logits [B, V]: the grammar's mask, allowed_token_ids, logit_bias.

    bitmask: int32 [B, ceil(V / 32)] packed (bit t % 32 of word t // 32: token t allowed), -1 for a row
    without a grammar. They come before everything else, so the "raw" distribution (logprobs, events,
    beam search) is the constrained one, as in vLLM and the OpenAI API."""
    if bitmask is not None:
        logits = logits.masked_fill(~unpack_bitmask(bitmask.to(logits.device), logits.shape[-1]), -torch.inf)
    if not any(p.allowed_token_ids is not None or p.logit_bias for p in params):
        return logits
    logits = logits.clone()
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            banned = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            banned[torch.tensor(p.allowed_token_ids, device=logits.device)] = False
            logits[row, banned] = -torch.inf
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[row, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 [B, W] -> bool [B, vocab_size]: which tokens each row allows."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def mask_effect(logits: torch.Tensor, bitmask: torch.Tensor, top_n: int = 0) -> list[MaskEffect]:
    """Per row of the model's logits [B, V] under bitmask [B, W]: how many tokens it allows, the model's
    probability mass (T=1) on the ones it removes, and the top_n of those."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    removed = torch.softmax(logits.float(), dim=-1).masked_fill(allowed, 0.0)  # [B, V]
    top = removed.topk(min(top_n, removed.shape[-1])) if top_n else None
    effects = []
    for b, (count, mass) in enumerate(zip(allowed.sum(dim=-1).tolist(), removed.sum(dim=-1).tolist(), strict=True)):
        rows = zip(top.indices[b].tolist(), top.values[b].tolist(), strict=True) if top is not None else ()
        effects.append(MaskEffect(count, mass, [(t, p) for t, p in rows if p > 0]))
    return effects


def final_distribution(logits: torch.Tensor, params: list[SamplingParams], eos_ids: list[int]) -> torch.Tensor:
    """The distribution each row samples from, [B, V]; greedy rows are one-hot on the argmax."""
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)
    if greedy.all():
        return torch.zeros_like(logits).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if not any(_truncates(p) for p in params):
        return _greedy_rows_one_hot(probs, logits, greedy)
    keep = truncation_mask(
        probs,
        torch.tensor([p.top_k for p in params], device=device),
        torch.tensor([p.top_p for p in params], device=device),
        torch.tensor([p.min_p for p in params], device=device),
    )
    protect = torch.tensor([not p.truncate_eos for p in params], device=device)
    for eos in eos_ids:
        keep[:, eos] |= protect
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return _greedy_rows_one_hot(probs, logits, greedy)


def _greedy_rows_one_hot(probs: torch.Tensor, logits: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    if not greedy.any():
        return probs
    one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _truncates(p: SamplingParams) -> bool:
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)


def penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def uniform(generator: torch.Generator) -> float:
    """One uniform draw in [0, 1) from a sequence's own random stream (the scheduler's side draws them)."""
    return torch.rand((), generator=generator).item()


def draw(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Inverse-CDF sampling with one uniform per row: [B] token ids.

    The uniforms come in as numbers, drawn on the scheduler's side from each sequence's generator:
    the executor that samples holds no random state, so a StepInput alone decides the step."""
    u = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return idx.squeeze(-1).clamp(max=probs.shape[-1] - 1)


def distributions(logits: torch.Tensor, params: list[SamplingParams], eos_ids: list[int],
                  histories: list[list[int]] | None = None, prompt_lens: list[int] | None = None,
                  bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw log-probs at T=1, constrained and penalised logits, final distribution), each [B, V].

    histories: each row's tokens so far (prompt + output), prompt_lens where its output starts; they
    are read (and the outputs cut from them) only when a row asks for a penalty. bitmask: the
    grammars' masks (`constrain`)."""
    logits = constrain(logits.float(), params, bitmask)
    raw_log = torch.log_softmax(logits, dim=-1)
    adjusted = logits
    if any(penalised(p) for p in params):
        histories = histories or [[] for _ in params]
        lens = prompt_lens or [len(h) for h in histories]
        adjusted = apply_penalties(logits, params, histories, [h[n:] for h, n in zip(histories, lens, strict=True)])
    return raw_log, adjusted, final_distribution(adjusted, params, eos_ids)


def sample(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float],
           eos_ids: list[int], histories: list[list[int]] | None = None,
           prompt_lens: list[int] | None = None, bitmask: torch.Tensor | None = None) -> SamplerOutput:
    """Pick one token per row of logits [B, V] (histories, prompt_lens and bitmask as in `distributions`).

    uniforms: one per row, read by the rows that sample (a greedy row ignores its own)."""
    raw_log, adjusted, final = distributions(logits, params, eos_ids, histories, prompt_lens, bitmask)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    tokens = adjusted.argmax(dim=-1) if greedy.all() else torch.where(greedy, adjusted.argmax(dim=-1),
                                                                      draw(final, uniforms))
    chosen = raw_log.gather(-1, tokens[:, None]).squeeze(-1)
    return SamplerOutput(tokens.tolist(), chosen.tolist(), raw_log, final)
