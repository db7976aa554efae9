"""The model runner: one forward pass over the paged cache for a StepInput (step_input.py), and the
logits of the rows that sample (the executor, executor.py, samples them).

Every row contributes its query tokens to one flat list (prefill chunks and decode tokens side by
side). The attention metadata says, per row, where its queries start in that list, how long its
context is, and which blocks hold it; the slot mapping says where each new token's K/V is written.
The runner reads nothing but the StepInput: no sequence, so it could run in another process (a
tensor-parallel worker runs the same forward on its shard).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvscope.backend.engine.kv_cache import KVCache
from kvscope.backend.engine.step_input import StepInput, token_inputs
from kvscope.backend.model.attention import causal_attention
from kvscope.backend.model.joined import join_projections
from kvscope.backend.model.transformer import CausalLM


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block_id * block_size + offset) per query token
    query_starts: list[int]  # [num_seqs + 1] offsets of each sequence's queries in the flat batch
    context_lens: list[int]  # [num_seqs] keys each sequence attends to (cached + new)
    block_tables: list[list[int]]  # [num_seqs][blocks]
    # By query length, which is what the kernels care about (not the scheduler's phase): rows with
    # one query token go to the Triton decode kernel, the others to its variable-length prefill.
    decode_seqs: list[int]
    prefill_seqs: list[int]


SHORT_QUERY = 16  # sequences with at most this many query tokens (decodes, verifies) attend in one batch


class PagedTorchBackend:
    """Attention over the paged cache in plain torch: the reference for the Triton kernels.

    Short queries (decode rows, speculative verifies, small chunks) attend in one padded batch;
    longer prefill chunks one by one, so that padding never multiplies a long chunk's cost.
    """

    absorb_mla = True  # the cache holds MLA's latent, so MLA layers attend in the absorbed form

    def __init__(self, cache: KVCache, meta: AttentionMetadata) -> None:
        self.cache, self.meta = cache, meta
        dev = cache.data.device
        starts, ctx = meta.query_starts, meta.context_lens
        q_lens = [starts[i + 1] - starts[i] for i in range(len(ctx))]
        self.short = [i for i, n in enumerate(q_lens) if n <= SHORT_QUERY]
        self.long = [i for i, n in enumerate(q_lens) if n > SHORT_QUERY]
        width = max((len(meta.block_tables[i]) for i in self.short), default=0)
        t = max((q_lens[i] for i in self.short), default=0)
        # Padded block tables of the short rows; padding points at block 0 and is masked out.
        self.short_tables = torch.tensor([meta.block_tables[i] + [0] * (width - len(meta.block_tables[i]))
                                          for i in self.short], dtype=torch.long, device=dev).view(len(self.short), width)
        # [B, T] rows of the flat batch; a padded query repeats the sequence's last row and is dropped.
        self.short_rows = torch.tensor([[starts[i] + min(j, q_lens[i] - 1) for j in range(t)] for i in self.short],
                                       dtype=torch.long, device=dev).view(len(self.short), t)
        self.short_valid = torch.tensor([[j < q_lens[i] for j in range(t)] for i in self.short],
                                        dtype=torch.bool, device=dev).view(len(self.short), t)
        # Absolute position of each query: it sees keys 0..position (bottom-right aligned causal mask).
        query_pos = torch.tensor([[ctx[i] - q_lens[i] + min(j, q_lens[i] - 1) for j in range(t)] for i in self.short],
                                 device=dev).view(len(self.short), t)
        self.short_visible = torch.arange(width * cache.block_size, device=dev) <= query_pos[..., None]  # [B, T, L]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.cache.write(layer, self.meta.slot_mapping, k, v)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # [num_tokens, n_heads, v_dim]
        if self.short:
            batched = self._short(layer, q[self.short_rows], scale)  # [B, T, Hq, Dv]
            out[self.short_rows[self.short_valid]] = batched[self.short_valid]
        for i in self.long:
            start, end = self.meta.query_starts[i], self.meta.query_starts[i + 1]
            out[start:end] = self._long(layer, q[start:end], i, scale)
        return out

    def _short(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """A few query rows per sequence over its whole context: q [B, T, Hq, D] -> [B, T, Hq, Dv]."""
        b, t, hq, d = q.shape
        keys = self.cache.gather_keys(layer, self.short_tables).flatten(1, 2)  # [B, L, Hkv, D], dequantized
        values = self.cache.gather_values(layer, self.short_tables).flatten(1, 2)  # [B, L, Hkv, Dv]
        hkv, length = keys.shape[2], keys.shape[1]
        g = hq // hkv  # a group's query heads share one K/V head: fold (group, T) into one query axis
        qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
        mask = self.short_visible[:, None].expand(b, g, t, length).reshape(b, 1, g * t, length)
        out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, scale=scale)  # [B, Hkv, G*T, Dv]
        return out.view(b, hkv, g, t, -1).permute(0, 3, 1, 2, 4).reshape(b, t, hq, -1)

    def _long(self, layer: int, q: torch.Tensor, i: int, scale: float) -> torch.Tensor:
        """A long chunk of queries over the cached prefix plus itself, causal within the chunk."""
        ctx, table = self.meta.context_lens[i], self.meta.block_tables[i]
        keys = self.cache.gather_keys(layer, table).flatten(0, 1)[:ctx]  # [ctx, Hkv, D], dequantized
        values = self.cache.gather_values(layer, table).flatten(0, 1)[:ctx]  # [ctx, Hkv, Dv]
        return causal_attention(q, keys, values, scale, q_offset=ctx - q.shape[0])


class DecodeTorchBackend(PagedTorchBackend):
    """PagedTorchBackend for a step whose every row decodes one token. Its attend reads tensors only, no
    per-row Python list, so torch.compile traces the whole model into one graph for any batch size."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.cache.write(layer, self.meta.slot_mapping, k, v)
        return self._short(layer, q[:, None], scale)[:, 0]  # q [B, Hq, D] -> [B, Hq, Dv]


def decode_forward(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor,
                   backend: DecodeTorchBackend) -> torch.Tensor:
    """The whole decode forward, [B] ids -> [B, hidden]: what `compiled_decode` compiles."""
    return model(ids, positions, backend)


@functools.cache
def compiled_decode() -> Callable[..., torch.Tensor]:
    """One compiled function for every runner: torch.compile guards on the model's structure, not its
    weights (which it takes as inputs), so runs of one model share the graph; dynamic=True makes the batch
    size and the block-table width symbols instead of constants (0 and 1 stay special: `_padded` avoids
    them). Made on first use: torch.compile imports triton, which must come after TRITON_INTERPRET is set."""
    return torch.compile(decode_forward, dynamic=True)


class PagedTritonBackend:
    """The same contract as PagedTorchBackend, on the Triton kernels in kernels/ (docs/kernels.md).

    Decode rows go through one split-K decode launch (MLA: the latent-cache kernel), all prefill
    chunks through one variable-length prefill launch, instead of a Python loop per sequence.
    """

    absorb_mla = True

    def __init__(self, cache: KVCache, meta: AttentionMetadata) -> None:
        # Here, not at the top: triton must be imported after the engine checked TRITON_INTERPRET.
        from kvscope.kernels import cache_write, mla_decode, paged_decode, paged_prefill

        self.cache_write, self.mla_decode = cache_write.write_kv_cache, mla_decode.mla_decode_attention
        self.paged_decode = paged_decode.paged_decode_attention
        self.paged_prefill = paged_prefill.paged_prefill_attention
        self.cache, self.meta = cache, meta
        dev = cache.data.device
        decode, prefill = meta.decode_seqs, meta.prefill_seqs
        self.decode_rows = torch.tensor([meta.query_starts[i] for i in decode], dtype=torch.long, device=dev)
        self.decode_tables = _padded_tables(meta.block_tables, decode, dev)  # [B, W] int32
        self.decode_lens = torch.tensor([meta.context_lens[i] for i in decode], dtype=torch.int32, device=dev)
        self.max_decode_len = max((meta.context_lens[i] for i in decode), default=0)
        q_lens = [meta.query_starts[i + 1] - meta.query_starts[i] for i in prefill]
        rows = [r for i in prefill for r in range(meta.query_starts[i], meta.query_starts[i + 1])]
        self.prefill_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        starts = [0, *itertools.accumulate(q_lens)]  # [P + 1], offsets into q[prefill_rows]
        self.prefill_starts = torch.tensor(starts, dtype=torch.int32, device=dev)
        self.prefill_tables = _padded_tables(meta.block_tables, prefill, dev)
        self.prefill_lens = torch.tensor([meta.context_lens[i] for i in prefill], dtype=torch.int32, device=dev)
        self.max_query_len = max(q_lens, default=0)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        latent = self.cache.latent_dim
        keys, values = self.cache.keys(layer), self.cache.values(layer)
        # int8 caches: the kernels quantize on write and dequantize with these [num_blocks, block_size, Hkv]
        # scales; None otherwise. MLA's value scale is the key row's own.
        ks, vs = self.cache.key_scales(layer), self.cache.value_scales(layer)
        # MLA: one plane, the value is a view of the key's latent part and is not written again.
        self.cache_write(k, None if latent else v, keys, None if latent else values,
                                    self.meta.slot_mapping, k_scale=ks, v_scale=None if latent else vs)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # [num_tokens, n_heads, v_dim]
        if self.meta.decode_seqs:
            out[self.decode_rows] = self._decode(layer, q[self.decode_rows], scale)
        if self.meta.prefill_seqs:
            out[self.prefill_rows] = self.paged_prefill(
                q[self.prefill_rows], keys, values, self.prefill_tables, self.prefill_starts, self.prefill_lens,
                scale, k_scale=ks, v_scale=vs, max_query_len=self.max_query_len)
        return out

    def _decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, Dv]."""
        keys, tables, lens, longest = self.cache.keys(layer), self.decode_tables, self.decode_lens, self.max_decode_len
        if self.cache.latent_dim is not None:
            # No int8 scales in the MLA kernel: check_kv_dtype refuses that combination at Engine construction.
            assert not self.cache.quantized, "MLA decode on Triton reads no int8 scales"
            return self.mla_decode(q, keys, tables, lens, self.cache.latent_dim, scale,
                                                     max_context_len=longest)
        return self.paged_decode(q, keys, self.cache.values(layer), tables, lens, scale,
                                                   k_scale=self.cache.key_scales(layer),
                                                   v_scale=self.cache.value_scales(layer), max_context_len=longest)


def _padded_tables(tables: list[list[int]], seqs: list[int], device: torch.device) -> torch.Tensor:
    """[len(seqs), W] int32 block tables; the kernels never read past a sequence's context, so pad with 0."""
    width = max((len(tables[i]) for i in seqs), default=0)
    rows = [tables[i] + [0] * (width - len(tables[i])) for i in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(seqs), width)


BACKENDS = {"torch": PagedTorchBackend, "triton": PagedTritonBackend}


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, attention: Literal["torch", "triton"] = "torch",
                 compile: bool = False, batch_invariant: bool = False) -> None:
        self.model, self.cache = model, cache
        self.batch_invariant = batch_invariant  # EngineConfig.batch_invariant: see `invariant_logits`
        join_projections(model)  # Q, K, V and gate, up as one matmul each: fewer ops per step (joined.py)
        self.backend = BACKENDS[attention]
        # Decode-only steps through one compiled graph (EngineConfig.compile_decode: torch backend only,
        # checked there), compiled now: the run's first decode step then costs a step, not a compile
        self.compile = compile
        self.compile_s = self.warm_up() if compile else 0.0

    def prepare(self, inp: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids and positions [num_tokens] on the device, and the attention metadata."""
        dev = self.cache.data.device
        rows = range(inp.num_rows)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(inp.slot_mapping, dtype=torch.long, device=dev),
            query_starts=inp.query_starts,
            context_lens=inp.context_lens,
            block_tables=inp.block_tables,
            decode_seqs=[i for i in rows if inp.num_query(i) == 1],
            prefill_seqs=[i for i in rows if inp.num_query(i) > 1],
        )
        return torch.tensor(inp.input_ids, device=dev), torch.tensor(inp.positions, device=dev), meta

    @torch.no_grad()
    def logits(self, inp: StepInput) -> torch.Tensor:
        """The forward alone: logits [len(inp.logit_rows), vocab], a row per sampling sequence, k + 1 per verify."""
        if self.batch_invariant:
            return self.invariant_logits(inp)
        return self.model.logits(self.forward(inp)[inp.logit_rows])

    def invariant_logits(self, inp: StepInput) -> torch.Tensor:
        """`logits`, each query token a forward of its own. A matmul's rows are not independent of each other
        on a CPU or a GPU: the library picks its blocking, vector width and split of the sum by the number of
        rows, so one token's row of x @ W changes in its last bits with the batch around it (a one-row product
        and the same row in a product of 64 differ in most of their 576 outputs on this project's CPU), and
        attention sums over a padded width set by the longest row. Here every token runs with one row and a
        block table exactly as long as its context, and every logits row is a product of one row: the same
        shapes, so the same order of every sum, whatever else was scheduled or cached."""
        rows = []  # [1, vocab] each
        for one in token_inputs(inp, self.cache.block_size):
            hidden = self.forward(one)  # [1, hidden]
            if one.logit_rows:
                rows.append(self.model.logits(hidden))
        return torch.cat(rows) if rows else self.model.logits(hidden[:0])

    @torch.no_grad()
    def forward(self, inp: StepInput) -> torch.Tensor:
        """Hidden states [num_tokens, hidden], the step's K/V written (all a tensor-parallel worker does)."""
        self.cache.copy_blocks(inp.block_copies)
        ids, positions, meta = self.prepare(inp)
        if self.compile and not meta.prefill_seqs:
            return self.forward_compiled(ids, positions, meta)
        return self.model(ids, positions, self.backend(self.cache, meta))

    def warm_up(self) -> float:
        """Compile the decode graph on two rows of one token written into block 0, then put block 0 back
        as it was (nothing reads it before a sequence writes it, but a run's pool is never left
        changed). Returns the seconds it took: a minute or more on 2 CPU cores, a few where torch's
        cache on disk already holds the graph."""
        start = time.perf_counter()
        block = self.cache.data[:, :, 0].clone()
        scales = None if self.cache.scales is None else self.cache.scales[:, :, 0].clone()
        dev = self.cache.data.device
        meta = AttentionMetadata(torch.tensor([0, 1], device=dev), [0, 1, 2], [1, 2], [[0], [0]], [0, 1], [])
        with torch.no_grad():
            self.forward_compiled(torch.zeros(2, dtype=torch.long, device=dev), torch.tensor([0, 1], device=dev), meta)
        self.cache.data[:, :, 0] = block
        if scales is not None:
            self.cache.scales[:, :, 0] = scales
        return time.perf_counter() - start

    def forward_compiled(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step through the compiled graph: hidden [B, hidden]."""
        b = len(ids)
        ids, positions, meta = _padded(ids, positions, meta)
        # No duck sizing: a batch as wide as its block tables would otherwise compile a graph of its own
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled_decode()(self.model, ids, positions, DecodeTorchBackend(self.cache, meta))[:b]


def _padded(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """At least two rows and two blocks a row, so that torch.compile's graph for sizes above 1 serves every
    step (it would compile sizes 0 and 1 apart). A second row repeats the last one: the same token written
    to the same slot, its output dropped. A second block is block 0, past the context and masked out."""
    tables = [list(t) for t in meta.block_tables]
    if max(len(t) for t in tables) < 2:
        tables[0].append(0)
    if len(ids) >= 2:
        return ids, positions, dataclasses.replace(meta, block_tables=tables)
    n = len(ids)
    meta = AttentionMetadata(torch.cat((meta.slot_mapping, meta.slot_mapping[-1:])), [*meta.query_starts, n + 1],
                             [*meta.context_lens, meta.context_lens[-1]], [*tables, tables[-1]],
                             [*meta.decode_seqs, n], [])
    return torch.cat((ids, ids[-1:])), torch.cat((positions, positions[-1:])), meta
