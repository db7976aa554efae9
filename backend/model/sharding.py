"""Tensor-parallel shards of the reference decoder, split the way Megatron-LM and vLLM split it.

Each of `world` ranks holds one shard and runs every layer on it; their hidden states stay equal:
- attention: q/k/v are column-parallel (a rank computes its own heads: output rows sliced), o_proj
  row-parallel (its input columns sliced: each rank's partial sum, then one all-reduce);
- KV heads are split with the query heads that read them. A model with fewer KV heads than ranks
  (GQA, MQA) replicates them, as vLLM does: rank r holds the one KV head its query heads share, so
  the KV pool per rank stops shrinking at one head;
- MLA: q_proj and kv_b_proj column-parallel by head, o_proj row-parallel; the latent projection
  (kv_a_proj_with_mqa) and its norm are replicated, and so is the latent cache, since every head
  reads the whole latent;
- SwiGLU: gate/up column-parallel (a slice of the intermediate size), down row-parallel;
- the embedding and norms are replicated (a lookup needs no all-reduce); the LM head lives on rank 0
  only, which samples: vocabulary-parallel would cut its memory but cost an all-gather of the logits
  every step, and the small models here tie it to the embedding that every rank holds anyway.
So a layer does two all-reduces of [num_tokens, hidden]. Sums taken in another order round
differently, so a shard's output equals the whole model's to float rounding, not bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from kvscope.backend.config import ModelConfig
from kvscope.backend.errors import KvscopeError
from kvscope.backend.model.mla import MLAttention
from kvscope.backend.model.quant import QuantLinear
from kvscope.backend.model.transformer import MLP, Attention, CausalLM

MAX_TENSOR_PARALLEL = 64
FIELD = "engine.tensor_parallel"


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` holds: [start, end) ranges of heads, KV heads and intermediate units."""

    rank: int
    world: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    kv_replicated: bool  # fewer KV heads than ranks: this rank's one KV head is also another rank's

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def check_tensor_parallel(config: ModelConfig, world: int) -> None:
    """Refuse a degree this model cannot be split by, naming the constraint (before anything is spawned)."""
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if not 1 <= world <= MAX_TENSOR_PARALLEL:
        raise KvscopeError(FIELD, f"{world} ranks; it must be 1 to {MAX_TENSOR_PARALLEL}")
    if heads % world:
        raise KvscopeError(FIELD, f"{world} does not divide the model's {heads} attention heads "
                                  "(each rank computes whole heads)")
    if config.mla is None and kv % world and world % kv:
        raise KvscopeError(FIELD, f"{world} ranks and {kv} KV heads: one must divide the other (KV heads are split "
                                  "across ranks, or each replicated on world / n_kv_heads ranks)")
    if inter % world:
        raise KvscopeError(FIELD, f"{world} does not divide the MLP's intermediate size ({inter})")


def shard_plan(config: ModelConfig, rank: int, world: int) -> ShardPlan:
    heads, inter = config.num_attention_heads // world, config.intermediate_size // world
    kv = 1 if config.mla else config.num_key_value_heads
    if kv >= world:
        per = kv // world
        kv_range, replicated = (rank * per, (rank + 1) * per), False
    else:  # each KV head serves world / kv ranks' query heads
        head = rank // (world // kv)
        kv_range, replicated = (head, head + 1), True
    return ShardPlan(rank, world, (rank * heads, (rank + 1) * heads), kv_range,
                     (rank * inter, (rank + 1) * inter), replicated)


def shard_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The shape one rank's KV cache has: its heads and KV heads (MLA: the whole latent)."""
    if config.mla is not None:
        return config.model_copy(update={"num_attention_heads": plan.num_heads})
    return config.model_copy(update={"num_attention_heads": plan.num_heads, "num_key_value_heads": plan.num_kv_heads})


class RowParallelLinear(nn.Module):
    """y = all_reduce(x[..., shard] @ W[:, shard]^T) + b: the rank's partial sum of a layer whose input
    features are split, summed across ranks. The bias is added once, after the sum."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias)
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by `connect` on each rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.all_reduce(self.inner(x))
        return y if self.bias is None else y + self.bias.to(y.dtype)


def connect(model: nn.Module, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Give every row-parallel layer of a shard the rank's all-reduce (not pickled with the shard)."""
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            m.all_reduce = all_reduce


def shard_model(model: CausalLM, plan: ShardPlan, codes: dict[int, torch.Tensor] | None = None) -> CausalLM:
    """A copy of `model` holding only rank `plan.rank`'s share; `model` itself is untouched.

    As quantize_model does, the sliced layers are built from the original weights and slotted in through
    deepcopy's memo, so no second full copy of them is made. The replicated embedding and LM head are the
    model's own (read-only at inference: rank 0's shard shares them; a worker's gets them pickled); the
    norms are copied. codes: quantized layers' integer codes, kept across the calls for each rank
    (reading torch's int4 packing back is the slow part of sharding a GGUF file)."""
    c = model.config
    codes = {} if codes is None else codes
    memo: dict[int, nn.Module] = {id(model.model.embed_tokens): model.model.embed_tokens, id(model.lm_head): model.lm_head}
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(attn, MLAttention):
            memo[id(attn.q_proj)] = _columns(codes, attn.q_proj, _heads(plan.heads, attn.nope + attn.rope))
            memo[id(attn.kv_b_proj)] = _columns(codes, attn.kv_b_proj, _heads(plan.heads, attn.nope + attn.v_dim))
            memo[id(attn.o_proj)] = _rows(codes, attn.o_proj, _scaled(plan.heads, attn.v_dim))
        elif isinstance(attn, Attention):
            memo[id(attn.q_proj)] = _columns(codes, attn.q_proj, _heads(plan.heads, c.head_dim))
            memo[id(attn.k_proj)] = _columns(codes, attn.k_proj, _heads(plan.kv_heads, c.head_dim))
            memo[id(attn.v_proj)] = _columns(codes, attn.v_proj, _heads(plan.kv_heads, c.head_dim))
            memo[id(attn.o_proj)] = _rows(codes, attn.o_proj, _scaled(plan.heads, c.head_dim))
        assert isinstance(mlp, MLP)
        memo[id(mlp.gate_proj)] = _columns(codes, mlp.gate_proj, _heads(plan.intermediate, 1))
        memo[id(mlp.up_proj)] = _columns(codes, mlp.up_proj, _heads(plan.intermediate, 1))
        memo[id(mlp.down_proj)] = _rows(codes, mlp.down_proj, plan.intermediate)
    if plan.rank and not _tied(model):
        memo[id(model.lm_head)] = nn.Identity()  # only rank 0 computes logits
    shard = copy.deepcopy(model, memo)
    for layer in shard.model.layers:
        layer.self_attn.n_heads = plan.num_heads
        if isinstance(layer.self_attn, Attention):
            layer.self_attn.n_kv_heads = plan.num_kv_heads
    return shard


def _heads(span: tuple[int, int], width: int) -> torch.Tensor:
    """The output rows of units span[0]..span[1] of `width` rows each."""
    return torch.arange(span[0] * width, span[1] * width)


def _scaled(span: tuple[int, int], width: int) -> tuple[int, int]:
    return span[0] * width, span[1] * width


def _tied(model: CausalLM) -> bool:
    lm_head = model.lm_head
    if isinstance(lm_head, QuantLinear):  # a GGUF file's tied int8 rows: the embedding reads the head's codes
        return getattr(model.model.embed_tokens, "codes", None) is lm_head.qweight
    return lm_head.weight is model.model.embed_tokens.weight


def _codes(cache: dict[int, torch.Tensor], linear: QuantLinear) -> torch.Tensor:
    if id(linear) not in cache:
        cache[id(linear)] = linear.codes()
    return cache[id(linear)]


def _columns(cache: dict[int, torch.Tensor], linear: nn.Module, rows: torch.Tensor) -> nn.Module:
    """Column-parallel: the output features `rows` of a linear layer (float or quantized)."""
    bias = None if linear.bias is None else linear.bias.detach()[rows].clone()
    if isinstance(linear, QuantLinear):
        zeros = linear.group_zeros()
        q = QuantLinear(linear.in_features, len(rows), linear.mode, linear.group_size, bias, linear.dtype)
        return q.load_codes(_codes(cache, linear)[rows], linear.group_scales()[rows] if linear.group_size else
                            linear.group_scales(), None if zeros is None else zeros[rows]).to(_device(linear))
    out = nn.Linear(linear.in_features, len(rows), bias=bias is not None, device="meta")
    out.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


def _rows(cache: dict[int, torch.Tensor], linear: nn.Module, span: tuple[int, int]) -> RowParallelLinear:
    """Row-parallel: input features [start, end) of a linear layer, its bias kept for after the sum."""
    start, end = span
    bias = None if linear.bias is None else linear.bias.detach().clone()
    if isinstance(linear, QuantLinear):
        g = linear.group_size
        grouped = g and g != linear.in_features  # not per tensor, nor one group a row (int8 per channel)
        if grouped and start % g:
            raise KvscopeError(FIELD, f"a rank's slice of a layer's {linear.in_features} inputs starts at {start}, "
                                      f"inside a quantization group of {g}; use fewer ranks or a smaller group")
        group = g if grouped or not g else end - start  # a row's one scale now covers the slice's inputs
        scales, zeros = linear.group_scales(), linear.group_zeros()
        cols = slice(start // g, end // g) if grouped else slice(None)
        q = QuantLinear(end - start, linear.out_features, linear.mode, group, None, linear.dtype)
        inner = q.load_codes(_codes(cache, linear)[:, start:end], scales[:, cols],
                             None if zeros is None else zeros[:, cols]).to(_device(linear))
    else:
        inner = nn.Linear(end - start, linear.out_features, bias=False, device="meta")
        inner.weight = nn.Parameter(linear.weight.detach()[:, start:end].clone(), requires_grad=False)
    return RowParallelLinear(inner, bias)


def _device(linear: nn.Module) -> torch.device:
    return linear.qweight.device if isinstance(linear, QuantLinear) else linear.weight.device
