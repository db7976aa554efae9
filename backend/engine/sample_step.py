"""The executor's last stage: a step's logits to tokens, as a StepOutput (step_output.py).

Rows of logits follow the StepInput's `logit_rows`: one per sampling row, k + 1 per verify row.
Sampling rows are drawn together (each from its own uniforms, so batching changes nothing), verify
rows judge their drafts by modified rejection sampling (rejection.verify) against the proposer's
distributions the executor kept, beam rows hand back their best candidates. Everything the
scheduler's side needs comes back as numbers: no logits leave the executor, only what observers
asked for (the top-N rows of each distribution, and whole T=1 rows when the what-if keeps them).
A row that cannot be sampled (a grammar that leaves no token allowed, logits that are not numbers)
comes back as an error of its own (`RowOutput.error`), with no token and no number: one request's
grammar never fails the batch, and no NaN leaves the executor.
"""

from __future__ import annotations

import dataclasses

import torch

from kvscope.backend.engine.sampler import constrain, distributions, mask_effect, penalised, sample
from kvscope.backend.engine.rejection import verify
from kvscope.backend.engine.step_input import RowSampling, StepInput
from kvscope.backend.engine.step_output import RowOutput, StepOutput, TopLogprobs


MIN_LOGPROB = -9999.0


def sample_step(logits: torch.Tensor, inp: StepInput, draft_q: dict[int, torch.Tensor] | None = None) -> StepOutput:
    """logits [len(inp.logit_rows), V] -> one RowOutput per row of `inp` (None where nothing samples).

    draft_q: seq_id -> [k, V] the draft model's distributions of a verify row's drafts (the first
    rows: the scheduler may verify fewer than were drafted); a verify row without one judged
    one-hot drafts (n-gram lookup)."""
    rows: list[RowOutput | None] = [None] * inp.num_rows
    drawn: list[tuple[int, int]] = []  # (row, its logits row) of the rows that sample
    at = 0
    for i, how in enumerate(inp.sampling):
        if how is None:
            continue
        if how.kind == "verify":
            q = (draft_q or {}).get(inp.seq_ids[i])
            q = None if q is None else q[:len(how.drafts)]  # [k, V]
            rows[i] = _verify_row(logits[at:at + inp.num_query(i)], how, inp, q)
            at += inp.num_query(i)
        elif how.kind == "beam":
            rows[i] = _beam_row(logits[at], how)
            at += 1
        else:
            drawn.append((i, at))
            at += 1
    assert at == logits.shape[0], "every row of logits belongs to one sampling row"
    if drawn:
        for i, out in zip((i for i, _ in drawn), _sample_rows(logits, drawn, inp), strict=True):
            rows[i] = out
    return StepOutput(rows)


def _sample_rows(logits: torch.Tensor, drawn: list[tuple[int, int]], inp: StepInput) -> list[RowOutput]:
    """One batched draw for every stream of every sampling row (n streams share their row's logits)."""
    streams = [(i, r, s) for i, r in drawn for s in range(inp.sampling[i].streams)]
    how = [inp.sampling[i] for i, _, _ in streams]
    rows, masks = logits[[r for _, r, _ in streams]], stacked_masks(how, logits.shape[-1])
    result = sample(rows, [h.params for h in how],
                    [h.uniforms[s] if h.uniforms else 0.0 for h, (_, _, s) in zip(how, streams, strict=True)],
                    inp.eos_ids, [h.history or [] for h in how], [h.prompt_len for h in how], masks)
    errors = row_errors(result.raw_logprobs, result.final_probs, masks)
    effect = mask_effect(rows, masks, inp.dist_top_n) if masks is not None else None
    raw_probs = result.raw_probs
    tops = top_rows(raw_probs, result.final_probs, result.token_ids, inp.dist_top_n, inp.eos_ids)
    outs, start = [], 0
    for i, _ in drawn:
        js = list(range(start, start + inp.sampling[i].streams))  # a row's streams sit side by side
        start = js[-1] + 1
        if error := next((errors[j] for j in js if errors[j]), None):
            outs.append(RowOutput(error=error))
            continue
        asks = inp.sampling[i].params.logprobs
        outs.append(RowOutput(
            token_ids=[result.token_ids[j] for j in js], logprobs=[result.logprobs[j] for j in js],
            top_logprobs=[top_logprobs(result.raw_logprobs[j], asks) for j in js] if asks else None,
            tops=[tops[j] for j in js] if tops is not None else None,
            raw_probs=raw_probs[js] if inp.keep_raw else None,
            grammar=[effect[j] for j in js] if effect and inp.sampling[i].allowed is not None else None))
    return outs


def _verify_row(logits: torch.Tensor, how: RowSampling, inp: StepInput, draft_q: torch.Tensor | None) -> RowOutput:
    """Judge k drafts against the target's k + 1 rows of logits [k + 1, V]; draft_q [k, V] or None (one-hot)."""
    drafts, k = how.drafts, len(how.drafts)
    # What each position's penalties see: the tokens before it, the drafts before it included.
    prefixes = [how.history + drafts[:j] for j in range(k + 1)] if penalised(how.params) else None
    raw_log, _, p = distributions(logits, [how.params] * (k + 1), inp.eos_ids, prefixes, [how.prompt_len] * (k + 1),
                                  how.allowed)
    errors = row_errors(raw_log, p, how.allowed)
    if errors[0]:  # the position after the sequence's last token: nothing can follow it
        return RowOutput(error=errors[0])
    bad = next((j for j, e in enumerate(errors) if e), None)
    if bad is not None:
        # A later position has nothing to draw from (a grammar stranded after some drafts): judge only the
        # drafts before it, whose positions all can be drawn from. Verifying fewer drafts is still exact;
        # the sequence meets the stranded position in a later step, as a plain decode.
        drafts, k = drafts[:bad - 1], bad - 1
        raw_log, p, logits = raw_log[:k + 1], p[:k + 1], logits[:k + 1]
        how = dataclasses.replace(how, uniforms=how.uniforms[:k] + how.uniforms[-1:], drafts=drafts)
        draft_q = None if draft_q is None else draft_q[:k]
    q = (draft_q if draft_q is not None else one_hot(drafts, p.shape[-1])).to(p.device)  # [k, V]
    verdict = verify(p, q, drafts, how.uniforms, how.params.greedy)
    new = drafts[:verdict.num_accepted] + [verdict.token_id]
    raw = raw_log[:len(new)].exp()
    out = RowOutput(token_ids=new, logprobs=raw_log[range(len(new)), new].tolist(), num_accepted=verdict.num_accepted,
                    source=verdict.source, draft_p=p[range(k), drafts].tolist(), draft_q=q[range(k), drafts].tolist(),
                    expected_accept=torch.minimum(p[:k], q).sum(-1).tolist() if k else [])
    if how.params.logprobs:
        out.top_logprobs = [top_logprobs(raw_log[j], how.params.logprobs) for j in range(len(new))]
    if how.allowed is not None:
        out.grammar = mask_effect(logits[:len(new)], how.allowed[:len(new)], inp.dist_top_n)
    out.tops = top_rows(raw, p[:len(new)], new, inp.dist_top_n, inp.eos_ids)
    if inp.dist_top_n:
        out.verify_dists = verify_rows(p, q, inp.dist_top_n)
    if inp.keep_raw:
        out.raw_probs = raw
    return out


def _beam_row(logits: torch.Tensor, how: RowSampling) -> RowOutput:
    """A beam's best next tokens by log-probability (after logit_bias and allowed_token_ids), best first."""
    logprobs = torch.log_softmax(constrain(logits[None].float(), [how.params])[0], dim=-1)  # [V]
    if error := row_errors(logprobs[None], logprobs[None], None)[0]:
        return RowOutput(error=error)
    best = logprobs.topk(min(how.beam_top, logprobs.shape[-1]))
    return RowOutput(candidates=list(zip(best.indices.tolist(), best.values.tolist(), strict=True)))


def row_errors(raw_logprobs: torch.Tensor, final: torch.Tensor, masks: torch.Tensor | None) -> list[str | None]:
    """Per row of log_softmax of the constrained logits [B, V] and of the final distribution [B, V]: why it
    cannot be sampled, or None. The raw row is read, not only the final one: a greedy row's final
    distribution is one-hot on its argmax even when every logit is -inf. No finite log-probability, or a
    NaN in either, leaves no token to give; when the grammar's mask allows nothing, the grammar is why."""
    # Two reductions over [B, V], both NaN-propagating: the largest raw log-probability is finite exactly when
    # some token is allowed and none is NaN; the final row's sum is finite when none of it is NaN.
    ok = (torch.isfinite(raw_logprobs.amax(-1)) & torch.isfinite(final.sum(-1))).tolist()
    empty = (masks == 0).all(-1).tolist() if masks is not None else [False] * len(ok)
    return [None if fine else GRAMMAR_STRANDED if stranded else NOT_A_NUMBER
            for fine, stranded in zip(ok, empty, strict=True)]


GRAMMAR_STRANDED = ("the structured output's grammar allows no token here: no continuation of this output "
                    "can match it, so the sequence ends")
NOT_A_NUMBER = "the model's scores for the next token are not numbers (NaN or infinite), so no token can be drawn"


def stacked_masks(how: list[RowSampling], vocab_size: int) -> torch.Tensor | None:
    """The grammar masks of rows that sample one token each, int32 [len(how), W]; -1 (all) for a row
    without a grammar. None when no row has one."""
    if all(h.allowed is None for h in how):
        return None
    everything = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
    return torch.stack([everything if h.allowed is None else h.allowed[0] for h in how])


def one_hot(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """[len(tokens), V]: the n-gram proposer's q, certain of each token it copied."""
    q = torch.zeros(len(tokens), vocab_size)
    q[range(len(tokens)), tokens] = 1.0
    return q


def top_logprobs(raw_logprobs: torch.Tensor, n: int) -> TopLogprobs:
    """The n likeliest tokens of one raw log-distribution [V], as OpenAI's `top_logprobs` lists them: the
    same numbers as the chosen token's logprob (a gather of the same row), so one token has one value. A
    token a mask removed (log 0) is -9999.0, as vLLM writes it: JSON has no -inf."""
    best = raw_logprobs.topk(n)
    return tuple((t, max(lp, MIN_LOGPROB)) for t, lp in zip(best.indices.tolist(), best.values.tolist(), strict=True))


def top_rows(raw_probs: torch.Tensor, final_probs: torch.Tensor, chosen: list[int], n: int,
             eos_ids: list[int]) -> list[list[list]] | None:
    """Per row of [B, V]: [token, raw p, final p] for the top n by raw p, plus the chosen token and EOS.
    A top token of raw p 0 is left out: where a grammar allows fewer than n tokens, the rest of the
    top n would be arbitrary ones it masked.

    One topk and one gather for the whole batch: with events `full` this runs every step. None when
    n is 0 (nobody draws distributions)."""
    if not n:
        return None
    chosen_ids = torch.tensor(chosen, device=raw_probs.device)[:, None]  # [B, 1]
    eos = torch.tensor(eos_ids, dtype=torch.long, device=raw_probs.device).expand(len(chosen), -1)
    ids = torch.cat((raw_probs.topk(n).indices, chosen_ids, eos), dim=1)  # [B, N+1+E]
    raw, final = raw_probs.gather(1, ids).tolist(), final_probs.gather(1, ids).tolist()
    rows = []
    for r, row_ids in enumerate(ids.tolist()):
        first: dict[int, int] = {}  # token -> its first column (the chosen token or EOS may repeat a top one)
        for i, t in enumerate(row_ids):
            if i >= n or raw[r][i] > 0:
                first.setdefault(t, i)
        rows.append([[t, raw[r][i], final[r][i]] for t, i in first.items()])
    return rows


def verify_rows(p: torch.Tensor, q: torch.Tensor, n: int) -> list[list[list]]:
    """Per verified position, [token, p, q] for the top n of p and of q (the bonus position has no q)."""
    q_full = torch.cat((q, torch.zeros_like(p[:1])))  # [k + 1, V]
    ids = torch.cat((p.topk(n).indices, q_full.topk(n).indices), dim=1)  # [k + 1, 2N]
    p_top, q_top = p.gather(1, ids).tolist(), q_full.gather(1, ids).tolist()
    return [[[t, p_top[j][i], q_top[j][i]] for i, t in enumerate(row)
             if row.index(t) == i and (p_top[j][i] > 0 or q_top[j][i] > 0)]
            for j, row in enumerate(ids.tolist())]
