"""A rank's shard as data: how each layer is stored (a description), and the shard rebuilt from it.

A tensor-parallel worker never receives a module: rank 0 describes how each linear layer of the
worker's shard is stored (float, int8 codes, int4 groups, with their group size) and sends the tensors
as a state dict (tp_runner.py). The worker builds the shard's structure itself, from the model's
config and its own ShardPlan (sharding.py): `CausalLM` on the meta device at the shard's head counts
and MLP width, so that every column-parallel layer already has its slice's shape; the row-parallel
ones wrapped in RowParallelLinear; each quantized layer a QuantLinear of the described mode. Then the
tensors are checked against that skeleton, name by name, shape and dtype, and put in its place
(`load_state_dict(assign=True)`: no second copy). So the shapes a worker computes with come from the
config and the plan, never from what it was sent; a description or a state dict that does not fit
is refused, naming the first tensor that does not.

This is nano-vllm's way (each rank builds its layers and loads only its slice into them, STYLE.md)
with one difference: the slices are cut on rank 0, which holds the loaded (perhaps quantized in
memory, perhaps GGUF) model a server shares between runs, rather than read from the files by each rank.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict, Field

from kvscope.backend.config import MAX_HIDDEN, ModelConfig
from kvscope.backend.model.quant import KERNEL_DTYPE, QuantEmbedding, QuantLinear
from kvscope.backend.model.quant_rules import QuantError, check_group_size
from kvscope.backend.model.sharding import RowParallelLinear, ShardPlan
from kvscope.backend.model.transformer import CausalLM

FloatName = Literal["float32", "float16", "bfloat16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ROW_PARALLEL = ("o_proj", "down_proj")  # sharding.shard_model splits these by input: a partial sum each


class ShardError(ValueError):
    """A shard description or state dict that does not fit the shard this rank builds."""


class Stored(BaseModel):
    """How one layer's weight is stored: floats, or integer codes with their scales (quant.py)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal["float", "int8", "int4"]
    group_size: int = Field(default=0, ge=0, le=MAX_HIDDEN)  # a quantized layer's, as its shard holds it
    dtype: FloatName = "float32"  # what a quantized layer's dequantized values come back as


class ShardStorage(BaseModel):
    """How a shard's layers are stored; `linears` names every linear layer but the LM head."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    linears: dict[str, Stored]
    embedding: Stored  # float, or int8 rows (QuantEmbedding)
    embedding_tied: bool = False  # int8 rows read from the LM head's own (a GGUF file's tied embedding)
    lm_head: Stored | None  # None: this rank computes no logits (sharding.py: rank 0 only, unless tied)


# ---- rank 0: describe --------------------------------------------------------------------------------


def describe_storage(shard: CausalLM) -> ShardStorage:
    """How `shard` (sharding.shard_model's) stores its layers."""
    modules = dict(shard.named_modules())
    linears = {name: _stored(m.inner if isinstance(m, RowParallelLinear) else m) for name, m in modules.items()
               if name != "lm_head" and isinstance(m, (nn.Linear, QuantLinear, RowParallelLinear))
               and not isinstance(modules.get(name.rpartition(".")[0]), RowParallelLinear)}  # not a wrapped one
    embed, lm_head = shard.model.embed_tokens, shard.lm_head
    tied = isinstance(embed, QuantEmbedding) and isinstance(lm_head, QuantLinear) and embed.codes is lm_head.qweight
    quantized = isinstance(embed, QuantEmbedding)
    embedding = Stored(kind="int8", dtype=_name(embed.dtype)) if quantized else Stored(kind="float")
    return ShardStorage(linears=linears, embedding=embedding, embedding_tied=tied,
                        lm_head=None if isinstance(lm_head, nn.Identity) else _stored(lm_head))


def _stored(layer: nn.Module) -> Stored:
    if isinstance(layer, QuantLinear):
        return Stored(kind=layer.mode, group_size=layer.group_size, dtype=_name(layer.dtype))
    assert isinstance(layer, nn.Linear), type(layer)
    return Stored(kind="float")


def _name(dtype: torch.dtype) -> FloatName:
    return str(dtype).removeprefix("torch.")  # type: ignore[return-value]


# ---- a worker: build and load ------------------------------------------------------------------------


def weight_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config whose CausalLM has exactly the shard's layer shapes: its heads, KV heads and MLP units."""
    update = {"num_attention_heads": plan.num_heads, "intermediate_size": plan.intermediate[1] - plan.intermediate[0]}
    if config.mla is None:
        update["num_key_value_heads"] = plan.num_kv_heads
    return config.model_copy(update=update)


def build_shard(config: ModelConfig, plan: ShardPlan, storage: ShardStorage, dtype: torch.dtype) -> CausalLM:
    """The shard's structure on the meta device (no memory): shapes from the config and the plan, each
    layer stored as `storage` says. ShardError when the description does not name this model's layers."""
    with torch.device("meta"):
        model = CausalLM(weight_config(config, plan)).to(dtype)
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
        if sorted(names) != sorted(storage.linears):
            odd = sorted(set(names) ^ set(storage.linears))
            raise ShardError(f"the description names other layers than this model has (first: {odd[0]!r})")
        for name in names:
            row = name.rsplit(".", 1)[-1] in ROW_PARALLEL
            model.set_submodule(name, _layer(model.get_submodule(name), storage.linears[name], row, name))
        model.lm_head = nn.Identity() if storage.lm_head is None else _layer(model.lm_head, storage.lm_head, False,
                                                                             "lm_head")
        model.model.embed_tokens = _embedding(model, storage, dtype)
    return model


def _layer(linear: nn.Linear, stored: Stored, row: bool, name: str) -> nn.Module:
    """The meta layer that holds `linear`'s shape stored as described (row-parallel: wrapped, its bias kept for
    after the all-reduce)."""
    bias = None if linear.bias is None else torch.empty_like(linear.bias)
    if stored.kind == "float":
        inner = nn.Linear(linear.in_features, linear.out_features, bias=bias is not None and not row,
                          dtype=linear.weight.dtype)
    else:
        try:
            check_group_size(linear.in_features, stored.group_size, stored.kind, name)
        except QuantError as e:
            raise ShardError(f"{name}: {e.reason}") from None
        inner = QuantLinear(linear.in_features, linear.out_features, stored.kind, stored.group_size,
                            None if row else bias, DTYPES[stored.dtype])
    return RowParallelLinear(inner, bias) if row else inner


def _embedding(model: CausalLM, storage: ShardStorage, dtype: torch.dtype) -> nn.Module:
    embed, stored = model.model.embed_tokens, storage.embedding
    if stored.kind == "float":
        return embed
    if stored.kind != "int8":
        raise ShardError(f"an embedding is stored as floats or int8 rows, not {stored.kind}")
    if storage.embedding_tied:
        head = model.lm_head
        if not (isinstance(head, QuantLinear) and head.kernel == "int8pack" and head.group_size):
            raise ShardError("a tied int8 embedding reads the LM head's int8 rows, and this LM head has none")
        return QuantEmbedding.tied_to(head)
    vocab, hidden = embed.weight.shape
    return QuantEmbedding(torch.empty(vocab, hidden, dtype=torch.int8), torch.empty(vocab, 1, dtype=KERNEL_DTYPE),
                          DTYPES[stored.dtype])


def load_shard(skeleton: CausalLM, state: dict[str, torch.Tensor], device: torch.device) -> CausalLM:
    """The skeleton with `state`'s tensors in place, on `device`: every tensor named, shaped and typed as the
    skeleton's (ShardError naming the first that is not), and no tensor left unloaded."""
    expected = skeleton.state_dict()
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        what = f"no tensor {missing[0]!r}" if missing else f"an unexpected tensor {unexpected[0]!r}"
        raise ShardError(f"the shard's weights have {what}")
    for name, want in expected.items():
        got = state[name]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ShardError(f"tensor {name!r} is {shape} {getattr(got, 'dtype', '')}; this shard holds "
                             f"{tuple(want.shape)} {want.dtype}")
    skeleton.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*skeleton.named_parameters(), *skeleton.named_buffers()] if t.is_meta]
    if left:
        raise ShardError(f"tensor {left[0]!r} was not sent")
    return skeleton.requires_grad_(False).to(device).eval()
