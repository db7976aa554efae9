"""The engine's event dicts, built here from what the step returned (the schema: backend/events/schema.py).

Every record the scheduler returns (request_output.py) becomes its event in `emit`, in the order
it happened, and the iteration and metrics events are written from the scheduler's output and
counters. The block events' fields are the block manager's own (its docstring is their contract):
they pass through as recorded. Nothing here changes the engine; an event the bus's level drops is
not built.
"""

from __future__ import annotations

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.dist_rows import DistRows, RecordedRows, row_bytes, row_text
from kvscope.backend.engine.metrics import KVSnapshot
from kvscope.backend.engine.request_output import (Arrived, BlockChange, Drafted, EngineOutput, Finished, Forked,
                                                   Preempted, Rejected, SeqEnded, Token, Verified)
from kvscope.backend.engine.scheduler_output import SchedulerOutput
from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.moments import mask_forced
from kvscope.backend.model.tokenizer import Tokenizer


BLOCK_FIELDS = ("block_id", "src_block_id", "dst_block_id")  # a block event's block numbers


def batch_rows(plan: SchedulerOutput, instance: int | None = None) -> list[dict]:
    """The iteration event's `batch`: each scheduled row (and, in a disaggregated run, its instance)."""
    where = {} if instance is None else {"instance": instance}
    return [{"request_id": r.request_id, "seq_id": r.seq_id, "phase": r.phase, "num_query_tokens": r.num_tokens,
             "context_len": r.context_len, **({"num_draft_tokens": r.num_draft} if r.phase == "verify" else {}),
             **where} for r in plan.rows]


class StepEvents:
    def __init__(self, bus: EventBus, config: EngineConfig, tokenizer: Tokenizer, block_offset: int = 0) -> None:
        """block_offset: where this engine's block numbers start in the events (a disaggregated engine's
        instances each have a pool of their own, numbered apart)."""
        self.bus, self.config, self.tokenizer, self.block_offset = bus, config, tokenizer, block_offset
        self._token_text: dict[int, str] = {}
        self.rows: DistRows | None = None  # a served run attaches one: each dist token's whole raw row
        self.recorded = RecordedRows()  # the tokens whose event carries its whole raw row (dist_rows.py)
        self._prompt_len: dict[str, int] = {}  # live requests: a token at this position is a sequence's first
        self._builders = {Arrived: self._arrived, Rejected: self._rejected, Forked: self._forked,
                          SeqEnded: self._seq_end, Preempted: self._preempt, Finished: self._finished,
                          Token: self._token, BlockChange: self._block, Drafted: self._drafted,
                          Verified: self._verified}

    def observing(self) -> tuple[int, bool]:
        """What the step must hand back for the events: top-N distribution rows per token (0: none), and
        whole raw rows (the what-if's: recorded in some events, kept by a served run)."""
        dist = self.bus.wants_dist
        return (self.config.dist_top_n if dist else 0), dist

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.token_text(token)
        return text

    def emit(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            self._builders[type(output)](output)

    # ---- requests and sequences -------------------------------------------------------------------

    def _arrived(self, a: Arrived) -> None:
        self._prompt_len[a.request_id] = a.num_prompt_tokens
        self.bus.emit("request_arrived", request_id=a.request_id, seq_id=a.seq_id, prompt_token_ids=a.prompt_token_ids,
                      prompt_text=a.prompt_text, sampling=a.sampling.model_dump(), max_tokens=a.max_tokens)

    def _rejected(self, r: Rejected) -> None:
        self._prompt_len.pop(r.request_id, None)
        self.bus.emit("request_rejected", request_id=r.request_id, field=r.field, reason=r.reason)

    def _forked(self, f: Forked) -> None:
        self.bus.emit("seq_fork", request_id=f.request_id, parent_seq_id=f.parent_seq_id, seq_id=f.seq_id,
                      position=f.position)

    def _seq_end(self, e: SeqEnded) -> None:
        self.bus.emit("seq_end", request_id=e.request_id, seq_id=e.seq_id, reason=e.reason)

    def _preempt(self, p: Preempted) -> None:
        self.bus.emit("preempt", request_id=p.request_id, seq_id=p.seq_id, num_blocks_freed=p.num_blocks_freed,
                      mode="recompute")

    def _finished(self, f: Finished) -> None:
        self._prompt_len.pop(f.request_id, None)
        best = f.outputs[0]
        self.bus.emit("request_finished", request_id=f.request_id, seq_id=best["seq_id"], finish_reason=f.finish_reason,
                      reason=f.reason, output_token_ids=best["output_token_ids"], output_text=best["output_text"],
                      **f.times, num_cached_prompt_tokens=f.num_cached_prompt_tokens,
                      **({"outputs": list(f.outputs)} if f.multi else {}))

    def _block(self, b: BlockChange) -> None:
        if not self.block_offset:
            self.bus.emit(b.type, **b.fields)
            return
        self.bus.emit(b.type, **{k: v + self.block_offset if k in BLOCK_FIELDS else v for k, v in b.fields.items()})

    # ---- the iteration ----------------------------------------------------------------------------

    def iteration(self, plan: SchedulerOutput, duration: float, executing: float, extra: dict | None = None) -> None:
        """duration: the whole step's seconds; executing: the executor's share of them (inputs, forward,
        sampling), the rest being the scheduler's. extra: fields the runtime adds (simulate mode: the
        iteration's roofline `intensity` and `bound`)."""
        self.bus.emit(
            "iteration", batch=batch_rows(plan), num_batched_tokens=plan.num_batched_tokens,
            token_budget=self.config.max_num_batched_tokens, num_running=plan.num_running,
            num_waiting=plan.num_waiting, kv_blocks_used=plan.num_blocks_used, duration_s=duration,
            execute_s=executing, max_num_seqs=self.config.max_num_seqs, **(extra or {}),
        )
        self._masks(plan)

    def instances_iteration(self, parts: list[tuple[int, SchedulerOutput, float, float]]) -> None:
        """A disaggregated engine's one iteration event for all its instances: (instance, plan, duration,
        executing) each. Every row names its instance; the counts are their sums, the budget and slots
        every instance's; the step lasts as long as its slowest instance (they run side by side)."""
        n = len(parts)
        self.bus.emit(
            "iteration", batch=[row for i, plan, _, _ in parts for row in batch_rows(plan, i)],
            num_batched_tokens=sum(p.num_batched_tokens for _, p, _, _ in parts),
            token_budget=self.config.max_num_batched_tokens * n, num_running=sum(p.num_running for _, p, _, _ in parts),
            num_waiting=sum(p.num_waiting for _, p, _, _ in parts),
            kv_blocks_used=sum(p.num_blocks_used for _, p, _, _ in parts),
            duration_s=max((d for *_, d, _ in parts), default=0.0), execute_s=max((e for *_, e in parts), default=0.0),
            max_num_seqs=self.config.max_num_seqs * n,
            instances=[{"instance": i, "num_batched_tokens": p.num_batched_tokens, "num_running": p.num_running,
                        "num_waiting": p.num_waiting, "kv_blocks_used": p.num_blocks_used, "duration_s": d}
                       for i, p, d, _ in parts],
        )
        for _, plan, _, _ in parts:
            self._masks(plan)

    def _masks(self, plan: SchedulerOutput) -> None:
        if self.bus.wants("attention_mask"):
            for r in plan.rows:
                begin = r.context_len - r.num_tokens
                kind = r.phase if r.phase != "prefill" else ("chunked_prefill" if begin > 0 else "prefill")
                self.bus.emit("attention_mask", request_id=r.request_id, seq_id=r.seq_id, kind=kind,
                              query_positions=[begin, r.context_len], key_len=r.context_len)

    def kv_transfer(self, request_id: str, seq_ids: list[int], src: int, dst: int, src_blocks: list[int],
                    dst_blocks: list[int], num_bytes: int, link_s: float) -> None:
        """A prefilled request's blocks moved between instances (block numbers as the block events give them)."""
        self.bus.emit("kv_transfer", request_id=request_id, seq_ids=seq_ids, src_instance=src, dst_instance=dst,
                      src_blocks=src_blocks, dst_blocks=dst_blocks, bytes=num_bytes, link_s=link_s)

    def metrics(self, tokens_per_s: float, kv: KVSnapshot, prefix_hit_rate: float, num_preemptions: int,
                num_running: int, num_waiting: int, spec: dict[str, float]) -> None:
        self.bus.emit("metrics", tokens_per_s=tokens_per_s, kv_usage=kv.usage, kv_waste=kv.waste,
                      prefix_hit_rate=prefix_hit_rate, num_preemptions=num_preemptions,
                      num_running=num_running, num_waiting=num_waiting,
                      kv_blocks_saved_by_sharing=kv.blocks_saved_by_sharing, **spec)

    # ---- tokens -----------------------------------------------------------------------------------

    def _token(self, t: Token) -> None:
        if not self.bus.wants("token"):
            return
        fields = {"request_id": t.request_id, "seq_id": t.seq_id, "position": t.position,
                  "token_id": t.token_id, "text": self.token_text(t.token_id), "logprob": t.logprob, "source": t.source}
        p = t.params
        if t.dist is not None:
            fields["dist"] = {"top": [[tok, self.token_text(tok), raw, final] for tok, raw, final in t.dist],
                              "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p}
        if t.top_logprobs is not None:
            fields["top_logprobs"] = [[tok, self.token_text(tok), lp] for tok, lp in t.top_logprobs]
        if t.grammar is not None:
            fields["num_allowed"], fields["masked_mass"] = t.grammar.num_allowed, t.grammar.masked_mass
            if "dist" in fields:  # the tokens the mask took from the model: the view's first stage
                fields["dist"]["masked"] = [[tok, self.token_text(tok), prob] for tok, prob in t.grammar.masked_top]
        if "dist" in fields and t.raw_probs is not None:
            self._keep_row(t, fields)
        self.bus.emit("token", **fields)

    def _keep_row(self, t: Token, fields: dict) -> None:
        """The token's whole raw row: to the served run's store, and into its event when it is one to record."""
        # the top rows hold every token a grammar allowed when it allowed no more than they are: no row needed
        whole = t.grammar is not None and t.grammar.num_allowed <= self.config.dist_top_n
        first = not whole and t.position == self._prompt_len.get(t.request_id)
        forced = not whole and t.grammar is not None and mask_forced(fields)
        if self.rows is None and not (first or forced):
            return  # nothing wants this row: skip the copy
        row = row_bytes(t.raw_probs)
        if self.rows is not None:
            self.rows.put(t.request_id, t.seq_id, t.position, row)
        if self.recorded.take(first, forced, len(row)):
            fields["dist"]["raw_probs_f32"] = row_text(row)

    # ---- speculative decoding ---------------------------------------------------------------------

    def _drafted(self, d: Drafted) -> None:
        if d.token_ids and self.bus.wants("spec_propose"):
            self.bus.emit("spec_propose", request_id=d.request_id, seq_id=d.seq_id, token_ids=d.token_ids,
                          q_probs=d.q_probs, method=d.method, position=d.position, draft_seq_id=d.draft_seq_id,
                          token_texts=[self.token_text(t) for t in d.token_ids])

    def _verified(self, v: Verified) -> None:
        """The verdict, p and q of each draft, the top-N dists (step_output.RowOutput's verify fields)."""
        if not self.bus.wants("spec_verify"):
            return
        row, accepted = v.row, v.row.num_accepted
        results = [{"token_id": t, "text": self.token_text(t), "p": row.draft_p[j], "q": row.draft_q[j],
                    "accepted": j < accepted} for j, t in enumerate(v.drafts)]
        fields = {}
        if row.verify_dists is not None and self.bus.wants_dist:
            fields["dists"] = [[[t, self.token_text(t), p, q] for t, p, q in position] for position in row.verify_dists]
        resampled = row.source == "resampled"
        closing = row.token_ids[-1]
        self.bus.emit("spec_verify", request_id=v.request_id, seq_id=v.seq_id, position=v.position,
                      results=results, num_accepted=accepted,
                      resampled_token_id=closing if resampled else None,
                      bonus_token_id=None if resampled else closing, expected_accept=row.expected_accept, **fields)
