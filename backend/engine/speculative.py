"""Speculative decoding's proposers, on the executor's side: a cheap proposer drafts k tokens, the
target checks them all in the next step's forward.

Exactness comes from the acceptance rule (rejection.py, run by the executor): whatever the
proposer's q is, every appended token is distributed exactly as the target would have sampled it.
Each proposer answers a DraftInput (step_input.py) with the drafted ids, and keeps q for the verify.

- `DraftModelProposer`: a small model with its own KV cache tensors whose blocks the scheduler
  reserves from the engine's block manager (so they show in the block pool), under the draft
  model's own sequence ids (cache namespace 1).
- `NgramProposer`: prompt lookup, no model. q is one-hot on the copied tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.kv_cache import KVCache
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.runner import ModelRunner
from kvscope.backend.engine.sampler import penalised, sample
from kvscope.backend.engine.step_input import DraftInput, DraftRow, RowTokens, step_input
from kvscope.backend.engine.step_output import DraftOutput
from kvscope.backend.model.loader import LoadedModel, ModelLoadError, load_model
from kvscope.backend.phase import phase_of

DraftQ = dict[int, torch.Tensor]  # target seq_id -> [k, V] the distribution each draft was drawn from


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens, copy what followed."""

    method = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, inp: DraftInput) -> tuple[DraftOutput, DraftQ]:
        drafts = [lookup(r.token_ids, r.num_drafts, self.max_n, self.min_n) for r in inp.rows]
        return DraftOutput(drafts, [[1.0] * len(d) for d in drafts]), {}  # a copy is certain: q is one-hot


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class DraftModelProposer:
    """A small draft model drafting autoregressively over its own paged cache.

    A row first catches up on the target's tokens its draft sequence has not computed (the whole
    prompt the first time, afterwards the last accepted tokens) in one forward, then drafts one
    token per forward; the rows of a round run as one batch. The slots of every forward were
    reserved by the scheduler before the pass (DraftRow.block_table)."""

    method = "draft"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    @torch.no_grad()
    def propose(self, inp: DraftInput) -> tuple[DraftOutput, DraftQ]:
        drafted: list[list[int]] = [[] for _ in inp.rows]
        qs: list[list[torch.Tensor]] = [[] for _ in inp.rows]  # each [V]
        for round_ in range(max((r.num_drafts for r in inp.rows), default=0)):
            active = [i for i, r in enumerate(inp.rows) if r.num_drafts > round_]
            rows = [inp.rows[i] for i in active]
            batch = [self._query(r, drafted[i]) for r, i in zip(rows, active, strict=True)]
            logits = self.runner.logits(step_input(batch, inp.block_copies if round_ == 0 else [],
                                                   self.cache.block_size))  # [len(batch), V]
            histories = [r.token_ids + drafted[i] for r, i in zip(rows, active, strict=True)] \
                if any(penalised(r.params) for r in rows) else None
            out = sample(logits, [r.params for r in rows],
                         [r.uniforms[round_] if r.uniforms else 0.0 for r in rows], inp.eos_ids, histories,
                         [r.prompt_len for r in rows])
            for j, i in enumerate(active):
                drafted[i].append(out.token_ids[j])
                qs[i].append(out.final_probs[j])
        q = {r.seq_id: torch.stack(q) for r, q in zip(inp.rows, qs, strict=True) if q}
        q_probs = [[float(q[r.seq_id][j, t]) for j, t in enumerate(d)] if d else []
                   for r, d in zip(inp.rows, drafted, strict=True)]
        return DraftOutput(drafted, q_probs), q

    @staticmethod
    def _query(row: DraftRow, drafted: list[int]) -> RowTokens:
        """The round's forward for one row: the catch-up at first, then the newest draft alone."""
        if drafted:
            tokens, start = drafted[-1:], len(row.token_ids) + len(drafted) - 1
        else:
            tokens, start = row.token_ids[row.start:], row.start
        return RowTokens(row.request_id, row.draft_seq_id, phase_of(len(tokens), 0, True, True, True), tokens,
                         start, row.block_table, samples=True)


def make_proposer(config: EngineConfig, vocab_size: int, draft: LoadedModel | None, target_cache: KVCache,
                  attention_backend: str, load: Callable[[str], LoadedModel] = load_model
                  ) -> NgramProposer | DraftModelProposer:
    """The proposer `engine.speculative` asks for; a draft model gets its own KV tensors over the shared blocks.

    `draft` None: `load` reads the draft model (a server's shared copy, or a fresh one)."""
    spec = config.speculative
    if spec.method == "ngram":
        return NgramProposer()
    if draft is None:
        try:
            draft = load(spec.draft_model)
        except ModelLoadError as e:
            raise RequestError("engine.speculative.draft_model", str(e)) from None
    if draft.config.vocab_size != vocab_size:
        raise RequestError("engine.speculative.draft_model",
                           f"its vocabulary has {draft.config.vocab_size} tokens, the target's {vocab_size}: "
                           "a draft must share the target's tokenizer")
    device = target_cache.data.device
    cache = KVCache(draft.config, target_cache.num_blocks, target_cache.block_size,
                    next(draft.model.parameters()).dtype, device, config.kv_cache_dtype)
    return DraftModelProposer(ModelRunner(draft.model.to(device), cache, attention_backend))
