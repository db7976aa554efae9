"""The event dicts the engine emits: each kind built in one place (the schema is backend/events/schema.py).

The engine's parts (request tracker, output processor, speculative decoder, scheduler callbacks)
report through these methods instead of building dicts, so an event's fields are written once.
"""

from __future__ import annotations


import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.block_manager import BlockManager
from kvscope.backend.engine.dist_rows import DistRows
from kvscope.backend.engine.metrics import KVSnapshot
from kvscope.backend.engine.request import Request
from kvscope.backend.engine.scheduler import ScheduledSeq, Scheduler
from kvscope.backend.engine.sequence import Sequence
from kvscope.backend.engine.step_output import MaskEffect, RowOutput
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.tokenizer import Tokenizer


class StepEvents:
    def __init__(self, bus: EventBus, config: EngineConfig, tokenizer: Tokenizer, eos_ids: list[int]) -> None:
        self.bus, self.config, self.tokenizer, self.eos_ids = bus, config, tokenizer, eos_ids
        self._token_text: dict[int, str] = {}
        self.rows: DistRows | None = None  # a served run attaches one: each dist token's whole raw row

    @property
    def wants_dist(self) -> bool:
        return self.bus.wants_dist

    def wants(self, kind: str) -> bool:
        return self.bus.wants(kind)

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.token_text(token)
        return text

    # ---- requests and sequences -------------------------------------------------------------------

    def request_arrived(self, req: Request) -> None:
        self.bus.emit("request_arrived", request_id=req.request_id, seq_id=req.seq.seq_id,
                      prompt_token_ids=req.prompt_ids, prompt_text=req.prompt_text,
                      sampling=req.params.model_dump(), max_tokens=req.max_tokens)

    def request_rejected(self, request_id: str, field: str, reason: str) -> None:
        self.bus.emit("request_rejected", request_id=request_id, field=field, reason=reason)

    def seq_fork(self, parent: Sequence, child: Sequence) -> None:
        self.bus.emit("seq_fork", request_id=child.request_id, parent_seq_id=parent.seq_id, seq_id=child.seq_id,
                      position=len(parent))

    def seq_end(self, seq: Sequence, reason: str) -> None:
        self.bus.emit("seq_end", request_id=seq.request_id, seq_id=seq.seq_id, reason=reason)

    def preempt(self, seq: Sequence, num_blocks: int) -> None:
        self.bus.emit("preempt", request_id=seq.request_id, seq_id=seq.seq_id, num_blocks_freed=num_blocks,
                      mode="recompute")

    def request_finished(self, req: Request) -> None:
        best, t = req.outputs[0], req.times
        self.bus.emit("request_finished", request_id=req.request_id, seq_id=best["seq_id"],
                      finish_reason=req.finish_reason, reason=req.abort_reason,
                      output_token_ids=best["output_token_ids"], output_text=req.output_text,
                      ttft_s=t.ttft(), tpot_s=t.tpot(), e2e_s=t.e2e(), queue_s=t.queue(),
                      num_cached_prompt_tokens=req.seq.num_cached_prompt_tokens,
                      **({"outputs": req.outputs} if req.multi else {}))

    # ---- the iteration ----------------------------------------------------------------------------

    def iteration(self, batch: list[ScheduledSeq], duration: float, scheduler: Scheduler,
                  blocks: BlockManager, extra: dict | None = None) -> None:
        """extra: fields the runtime adds (simulate mode: the iteration's roofline `intensity` and `bound`)."""
        self.bus.emit(
            "iteration",
            batch=[{"request_id": i.seq.request_id, "seq_id": i.seq.seq_id, "phase": i.phase,
                    "num_query_tokens": i.num_tokens, "context_len": i.context_len,
                    **({"num_draft_tokens": i.num_draft} if i.phase == "verify" else {})} for i in batch],
            num_batched_tokens=sum(i.num_tokens for i in batch), token_budget=self.config.max_num_batched_tokens,
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_blocks_used=blocks.num_used_blocks, duration_s=duration, max_num_seqs=self.config.max_num_seqs,
            **(extra or {}),
        )
        if self.bus.wants("attention_mask"):
            for i in batch:
                begin = i.context_len - i.num_tokens
                kind = i.phase if i.phase != "prefill" else ("chunked_prefill" if begin > 0 else "prefill")
                self.bus.emit("attention_mask", request_id=i.seq.request_id, seq_id=i.seq.seq_id, kind=kind,
                              query_positions=[begin, i.context_len], key_len=i.context_len)

    def metrics(self, tokens_per_s: float, kv: KVSnapshot, blocks: BlockManager, scheduler: Scheduler,
                spec: dict[str, float]) -> None:
        self.bus.emit("metrics", tokens_per_s=tokens_per_s, kv_usage=kv.usage, kv_waste=kv.waste,
                      prefix_hit_rate=blocks.prefix_hit_rate, num_preemptions=scheduler.num_preemptions,
                      num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                      kv_blocks_saved_by_sharing=kv.blocks_saved_by_sharing, **spec)

    # ---- tokens -----------------------------------------------------------------------------------

    def token(self, req: Request, seq: Sequence, token: int, logprob: float, raw_probs: torch.Tensor | None,
              top: list | None, source: str = "target",
              alternatives: tuple[tuple[int, float], ...] | None = None,
              grammar: MaskEffect | None = None) -> None:
        """One token event; raw_probs [V] is the T=1 distribution it came from (kept for the what-if),
        top its distribution's rows [token, raw p, final p] (step_output.RowOutput.tops), alternatives its
        top_logprobs when the request asks, grammar what the structured output's mask did."""
        if not self.bus.wants("token"):
            return
        fields = {"request_id": req.request_id, "seq_id": seq.seq_id, "position": len(seq),
                  "token_id": token, "text": self.token_text(token), "logprob": logprob, "source": source}
        p = req.params
        if top is not None:
            fields["dist"] = {"top": [[t, self.token_text(t), raw, final] for t, raw, final in top],
                              "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                              "min_p": p.min_p}
            if self.rows is not None and raw_probs is not None:
                self.rows.put(req.request_id, seq.seq_id, fields["position"], raw_probs)
        if alternatives is not None:
            fields["top_logprobs"] = [[t, self.token_text(t), lp] for t, lp in alternatives]
        if grammar is not None:
            fields["num_allowed"], fields["masked_mass"] = grammar.num_allowed, grammar.masked_mass
            if "dist" in fields:  # the tokens the mask took from the model: the view's first stage
                fields["dist"]["masked"] = [[t, self.token_text(t), p] for t, p in grammar.masked_top]
        self.bus.emit("token", **fields)

    # ---- speculative decoding ---------------------------------------------------------------------

    def spec_propose(self, seq: Sequence, drafts: list[int], q_probs: list[float], method: str,
                     draft_seq_id: int | None) -> None:
        if drafts and self.bus.wants("spec_propose"):
            self.bus.emit("spec_propose", request_id=seq.request_id, seq_id=seq.seq_id, token_ids=drafts,
                          q_probs=q_probs, method=method, position=len(seq),
                          draft_seq_id=draft_seq_id, token_texts=[self.token_text(t) for t in drafts])

    def spec_verify(self, seq: Sequence, drafts: list[int], row: RowOutput) -> None:
        """row: the verify row's output (step_output.py): the verdict, p and q of each draft, the top-N dists."""
        if not self.bus.wants("spec_verify"):
            return
        accepted = row.num_accepted
        results = [{"token_id": t, "text": self.token_text(t), "p": row.draft_p[j], "q": row.draft_q[j],
                    "accepted": j < accepted} for j, t in enumerate(drafts)]
        fields = {}
        if row.verify_dists is not None and self.bus.wants_dist:
            fields["dists"] = [[[t, self.token_text(t), p, q] for t, p, q in position] for position in row.verify_dists]
        resampled = row.source == "resampled"
        closing = row.token_ids[-1]
        self.bus.emit("spec_verify", request_id=seq.request_id, seq_id=seq.seq_id, position=len(seq),
                      results=results, num_accepted=accepted,
                      resampled_token_id=closing if resampled else None,
                      bonus_token_id=None if resampled else closing, expected_accept=row.expected_accept, **fields)
