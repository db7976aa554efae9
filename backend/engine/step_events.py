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
from kvscope.backend.engine.speculative import Verdict
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
                      ttft_s=t.ttft(), tpot_s=t.tpot(), e2e_s=t.e2e(),
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
              alternatives: tuple[tuple[int, float], ...] | None = None) -> None:
        """One token event; raw_probs [V] is the T=1 distribution it came from (kept for the what-if),
        alternatives its top_logprobs (request_output.top_logprobs) when the request asks."""
        if not self.bus.wants("token"):
            return
        fields = {"request_id": req.request_id, "seq_id": seq.seq_id, "position": len(seq),
                  "token_id": token, "text": self.token_text(token), "logprob": logprob, "source": source}
        p = req.params
        if top is not None:
            fields["dist"] = {"top": top, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                              "min_p": p.min_p}
            if self.rows is not None and raw_probs is not None:
                self.rows.put(req.request_id, seq.seq_id, fields["position"], raw_probs)
        if alternatives is not None:
            fields["top_logprobs"] = [[t, self.token_text(t), lp] for t, lp in alternatives]
        self.bus.emit("token", **fields)

    def top_tokens(self, raw_probs: torch.Tensor, final_probs: torch.Tensor, chosen: list[int]) -> list[list[list]]:
        """Per row of [B, V]: the top N by raw probability, plus the chosen token and EOS when not among them.

        One topk and one gather for the whole batch: this runs every step when events are full."""
        chosen_ids = torch.tensor(chosen, device=raw_probs.device)[:, None]  # [B, 1]
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=raw_probs.device).expand(len(chosen), -1)
        ids = torch.cat((raw_probs.topk(self.config.dist_top_n).indices, chosen_ids, eos), dim=1)  # [B, N+1+E]
        raw = raw_probs.gather(1, ids).tolist()
        final = final_probs.gather(1, ids).tolist()
        texts, rows = self._token_text, []
        for r, row_ids in enumerate(ids.tolist()):
            first: dict[int, int] = {}  # token -> its first column (the chosen token or EOS may repeat a top one)
            for i, t in enumerate(row_ids):
                first.setdefault(t, i)
            rows.append([[t, texts.get(t) or self.token_text(t), raw[r][i], final[r][i]] for t, i in first.items()])
        return rows

    # ---- speculative decoding ---------------------------------------------------------------------

    def spec_propose(self, seq: Sequence, drafts: list[int], q: torch.Tensor, method: str,
                     draft_seq_id: int | None) -> None:
        if drafts and self.bus.wants("spec_propose"):
            self.bus.emit("spec_propose", request_id=seq.request_id, seq_id=seq.seq_id, token_ids=drafts,
                          q_probs=q[range(len(drafts)), drafts].tolist(), method=method, position=len(seq),
                          draft_seq_id=draft_seq_id, token_texts=[self.token_text(t) for t in drafts])

    def spec_verify(self, seq: Sequence, drafts: list[int], verdict: Verdict, p: torch.Tensor, q: torch.Tensor,
                    expected: list[float]) -> None:
        if not self.bus.wants("spec_verify"):
            return
        k = len(drafts)
        p_x, q_x = p[range(k), drafts].tolist(), q[range(k), drafts].tolist()
        results = [{"token_id": t, "text": self.token_text(t), "p": p_x[j], "q": q_x[j],
                    "accepted": verdict.accepted[j]} for j, t in enumerate(drafts)]
        fields = {}
        if self.bus.wants_dist:
            q_full = torch.cat((q, torch.zeros_like(p[:1])))  # [k + 1, V]: the bonus position has no draft
            n = self.config.dist_top_n
            ids = torch.cat((p.topk(n).indices, q_full.topk(n).indices), dim=1)  # [k + 1, 2N]
            p_top, q_top = p.gather(1, ids).tolist(), q_full.gather(1, ids).tolist()
            fields["dists"] = [[[t, self.token_text(t), p_top[j][i], q_top[j][i]] for i, t in enumerate(row)
                                if row.index(t) == i and (p_top[j][i] > 0 or q_top[j][i] > 0)]
                               for j, row in enumerate(ids.tolist())]
        resampled = verdict.source == "resampled"
        self.bus.emit("spec_verify", request_id=seq.request_id, seq_id=seq.seq_id, position=len(seq),
                      results=results, num_accepted=verdict.num_accepted,
                      resampled_token_id=verdict.token_id if resampled else None,
                      bonus_token_id=None if resampled else verdict.token_id, expected_accept=expected, **fields)
