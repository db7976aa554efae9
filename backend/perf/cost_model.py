"""A roofline cost model of one engine iteration: FLOPs, bytes and time of each op group.

Input: the batch of an `iteration` event (each row's phase, query tokens and context after the
step) and a deployment (model shape, hardware, tensor-parallel degree, weight and KV dtypes).
Each op group costs max(FLOPs / peak FLOP/s, bytes / bandwidth): a group is either waiting for
the tensor cores or for memory, never both at once (a profile may say its linear layers stream
weights below the bandwidth roof: hardware.py's efficiencies). The iteration is the sum of its
groups, the tensor-parallel all-reduces (and, over a measured local link, rank 0 posting the step to
the other ranks) and the profile's overheads (per iteration, per sequence, per token). Every figure
is per GPU: with tensor parallelism the ranks run in lock step, so one rank's time is the
iteration's time, rank 0's where it alone computes the LM head (`Deployment.vocab_parallel`).

What is counted (docs/perf_model.md has the formulas):
- linear layers: 2 FLOPs per weight per token; every weight read once per iteration at its
  stored dtype (int8/int4 codes plus group scales, bfloat16 where torch's kernels read them and
  float32 elsewhere, and for int4 at groups 32-256 a zero per group: the layout of
  backend/model/quant.py);
- LM head: only on rows that sample (a finishing prefill chunk's last token, every decode and
  verify token), read once when any row samples;
- attention: QK^T and PV over each row's real context, causal within the row's new tokens; MLA
  in its absorbed form (attention over the latent as one wide KV head); each row reads its whole
  context from the cache once and writes its new tokens, at the cache dtype (the KV formula of
  backend/config.py, int8 scales included);
- MoE: the shared and routed experts a token uses for FLOPs; for bytes, the experts the batch
  touches, expected under uniform routing.
Left out: norms, rotary, activations' traffic, the embedding lookup, sampling (a measured profile
carries them as per-token and per-sequence overheads). Assumed for the datasheet GPUs: kernels reach
their roofs (real ones reach 60-90% of them), so times are lower bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.backend.config import DTYPE_BYTES, KV_CACHE_DTYPES, kv_storage_dtype
from kvscope.backend.model.quant_rules import QuantError, check_group_size, kernel_for
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.phase import PHASES
from kvscope.backend.perf.hardware import THIS_MACHINE, HardwareProfile
from kvscope.backend.perf.ring import ring_bytes_sent
from kvscope.backend.perf.shapes import Linear, ModelShape

TP_DEGREES = (1, 2, 4, 8)
WEIGHT_QUANTS = ("none", "int8", "int4")
QUANT_SCALE_BYTES = 4  # quant.py keeps one float32 scale per group where it dequantizes ...
KERNEL_SCALE_BYTES = 2  # ... and bfloat16 scales (and zeros) where torch's kernels read them
ALL_REDUCES_PER_LAYER = 2  # Megatron tensor parallelism: after attention's o_proj and after the MLP


@dataclass(frozen=True)
class BatchItem:
    """One row of an iteration: a prefill chunk, a decode token or a verify window."""

    phase: str
    num_query_tokens: int
    context_len: int  # tokens in the cache after this iteration, the new ones included
    samples: bool = True  # prefill only: does the chunk finish the prompt, so its last token samples?

    @classmethod
    def from_event(cls, item: dict, index: int = 0) -> "BatchItem":
        """An `iteration` event's batch entry ({request_id, seq_id, phase, num_query_tokens, context_len})."""
        where = f"batch[{index}]"
        try:
            phase, q, ctx = item["phase"], int(item["num_query_tokens"]), int(item["context_len"])
        except (KeyError, TypeError, ValueError) as e:
            raise PerfError(where, f"needs phase, num_query_tokens and context_len ({e})") from None
        if phase not in PHASES:
            raise PerfError(f"{where}.phase", f"{phase!r} is not one of {', '.join(PHASES)}")
        if q < 1 or ctx < q:
            raise PerfError(where, f"needs 1 <= num_query_tokens ({q}) <= context_len ({ctx})")
        return cls(phase, q, ctx, bool(item.get("samples", True)))

    @property
    def sampled_rows(self) -> int:
        """Tokens whose logits the LM head computes."""
        if self.phase == "prefill":
            return 1 if self.samples else 0
        return self.num_query_tokens

    @property
    def keys_attended(self) -> int:
        """Query-key pairs: query i of q sits at position ctx - q + i and sees ctx - q + i + 1 keys."""
        q, ctx = self.num_query_tokens, self.context_len
        return q * (ctx - q) + q * (q + 1) // 2


@dataclass(frozen=True)
class Deployment:
    """A model shape on a GPU type: tensor-parallel degree, weight storage and KV cache dtype."""

    shape: ModelShape
    hardware: HardwareProfile
    tp: int = 1
    kv_cache_dtype: str = "auto"
    weight_quant: str = "none"
    quant_group_size: int = 64
    # (quant, group size) of lm_head where it is stored otherwise than the rest: a GGUF file run natively
    # keeps its Q8_0 embedding, tied to lm_head, as int8 rows beside int4 layers (gguf_weights.py)
    lm_head_quant: tuple[str, int] | None = None
    # True: lm_head split by vocabulary across ranks (vLLM). False: whole on rank 0, as kvscope's own
    # engine keeps it (model/sharding.py); rank 0 computes every logit, so its step prices all of it.
    vocab_parallel: bool = True

    def __post_init__(self) -> None:
        check_tp(self.tp, self.shape, self.hardware)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise PerfError("kv_cache_dtype", f"{self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.weight_quant not in WEIGHT_QUANTS:
            raise PerfError("weight_quant", f"{self.weight_quant!r} is not one of {', '.join(WEIGHT_QUANTS)}")
        if self.weight_quant != "none":
            check_quant_groups(self.shape, self.weight_quant, self.quant_group_size)

    @property
    def dtype(self) -> str:
        """Activations' dtype: matmuls run in it (quantized weights are dequantized to it)."""
        return self.shape.dtype

    @property
    def kv_bytes_per_token(self) -> float:
        """Cache bytes one token takes on one rank: KV heads split across ranks, MLA's latent replicated."""
        c = self.shape.config
        total = c.kv_bytes_per_token(kv_storage_dtype(self.kv_cache_dtype, self.dtype))
        if c.mla is not None:
            return total
        return total * math.ceil(c.num_key_value_heads / self.tp) / c.num_key_value_heads

    def weight_bytes(self, w: Linear) -> float:
        """One rank's stored bytes of a linear layer."""
        quant, group = self.lm_head_quant if self.lm_head_quant and w.name == "lm_head" else \
            (self.weight_quant, self.quant_group_size)
        return stored_bytes(w, self.dtype, quant, group) / self.split(w)

    def split(self, w: Linear) -> int:
        """Ranks this weight is divided between in this deployment."""
        return 1 if w.name == "lm_head" and not self.vocab_parallel else split(w, self.tp)


def check_tp(tp: int, shape: ModelShape, hardware: HardwareProfile) -> None:
    if tp > 1 and hardware.link is None:
        local_links = " (link gloo prices its ranks as processes on this host)" if hardware.name == THIS_MACHINE else ""
        raise PerfError("tp", f"{hardware.name} is a single device with no link between GPUs{local_links}")
    if hardware.link is not None and hardware.link.local:  # processes on one host: any number of them
        if tp < 1:
            raise PerfError("tp", f"must be at least 1, got {tp}")
    elif tp not in TP_DEGREES:
        raise PerfError("tp", f"must be one of {', '.join(map(str, TP_DEGREES))}, got {tp}")
    if shape.config.num_attention_heads % tp:
        raise PerfError("tp", f"{shape.name} has {shape.config.num_attention_heads} attention heads, "
                              f"which {tp} ranks cannot share evenly")


def check_quant_groups(shape: ModelShape, mode: str, group_size: int) -> None:
    """quant.py's own rule: the group size must tile every quantized layer's input dimension."""
    linears = shape.attention_linears() + shape.dense_mlp_linears() + [shape.lm_head()]
    if shape.moe is not None:
        linears += shape.expert_linears()
    try:
        for w in linears:
            check_group_size(w.in_features, group_size, mode, w.name)
    except QuantError as e:
        raise PerfError(e.field.removeprefix("engine."), e.reason) from None


def split(w: Linear, tp: int) -> int:
    """Ranks a weight is divided between."""
    return 1 if w.replicated else tp


def rank_bytes(w: Linear, dtype: str, quant: str, group_size: int, tp: int = 1) -> float:
    """One rank's stored bytes of a linear layer."""
    return stored_bytes(w, dtype, quant, group_size) / split(w, tp)


def stored_bytes(w: Linear, dtype: str, quant: str, group_size: int) -> float:
    """Bytes of a weight as stored: dtype, or int8 / packed int4 codes plus their scales (quant.py)."""
    if quant == "none":
        return w.params * DTYPE_BYTES[dtype]
    codes = w.params if quant == "int8" else w.params / 2
    scales = w.out_features * (w.in_features // group_size) if group_size else 1
    kernel = kernel_for(quant, group_size, w.in_features, w.out_features)
    if kernel == "int4pack":
        scales *= 2  # torch's int4 kernel reads a (scale, zero) pair per group
    return codes + scales * (KERNEL_SCALE_BYTES if kernel else QUANT_SCALE_BYTES)


# ---- results ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OpCost:
    """One op group of an iteration on one GPU."""

    group: str
    flops: float
    bytes: float  # memory (HBM/GDDR) traffic
    time_s: float
    bound: str  # memory, compute, or link (the all-reduces)
    link_bytes: float = 0.0  # bytes each rank sends over the link
    compute_s: float = 0.0  # its FLOPs at the compute roof
    memory_s: float = 0.0  # its bytes at the bandwidth it streams them at (time_s is the larger of the two)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf


@dataclass(frozen=True)
class IterationCost:
    ops: list[OpCost]
    overhead_s: float
    num_tokens: int
    sampled_rows: int
    peak_flops: float
    mem_bandwidth: float

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

    @property
    def bytes(self) -> float:
        return sum(op.bytes for op in self.ops)

    @property
    def roof_s(self) -> float:
        """The time the roofs allow: each op group waiting for its own roof (or the link), no fixed cost."""
        return sum(op.time_s for op in self.ops)

    @property
    def compute_s(self) -> float:
        """Every FLOP at the compute roof."""
        return sum(op.compute_s for op in self.ops)

    @property
    def memory_s(self) -> float:
        """Every byte at the bandwidth roof (a linear layer's at the rate it streams its weights)."""
        return sum(op.memory_s for op in self.ops)

    @property
    def time_s(self) -> float:
        return self.roof_s + self.overhead_s

    @property
    def intensity(self) -> float:
        """FLOPs per byte of memory traffic over the whole iteration."""
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.mem_bandwidth

    @property
    def bound(self) -> str:
        """Which roof the iteration as a whole sits under: memory below the ridge, compute above."""
        return "compute" if self.intensity > self.ridge else "memory"


# ---- the model -----------------------------------------------------------------------------------

def iteration_cost(dep: Deployment, batch: Sequence[BatchItem | dict]) -> IterationCost:
    """FLOPs, bytes and time of one iteration over `batch` (BatchItems or iteration-event dicts)."""
    items = [x if isinstance(x, BatchItem) else BatchItem.from_event(x, i) for i, x in enumerate(batch)]
    if not items:
        raise PerfError("batch", "an iteration needs at least one row")
    tokens = sum(x.num_query_tokens for x in items)
    rows = sum(x.sampled_rows for x in items)
    hw = dep.hardware
    peak, bw = hw.peak_flops(dep.dtype), hw.mem_bandwidth

    def roof(group: str, flops: float, nbytes: float, bandwidth: float = bw) -> OpCost:
        compute_s, memory_s = flops / peak, nbytes / bandwidth
        return OpCost(group, flops, nbytes, max(compute_s, memory_s), "compute" if compute_s > memory_s else "memory",
                      compute_s=compute_s, memory_s=memory_s)

    ops = [roof("attn_proj", *attention_projections(dep, tokens), hw.weight_bandwidth(tokens)),
           roof("mlp", *mlp(dep, tokens), hw.weight_bandwidth(tokens)),
           roof("attention", *attention(dep, items)),
           roof("lm_head", *lm_head(dep, rows), hw.weight_bandwidth(rows))]
    if dep.tp > 1:
        ops.extend(link_costs(dep, tokens))
    overhead = hw.iteration_overhead_s + hw.row_overhead_s * len(items) + hw.token_overhead_s * tokens
    return IterationCost(ops, overhead, tokens, rows, peak, bw)


def linears_cost(dep: Deployment, linears: list[Linear], tokens: float) -> tuple[float, float]:
    """(FLOPs, bytes) of running `tokens` tokens through these weights on one rank."""
    flops = sum(2 * tokens * w.params / dep.split(w) for w in linears)
    return flops, sum(dep.weight_bytes(w) for w in linears)


def attention_projections(dep: Deployment, tokens: int) -> tuple[float, float]:
    """q/k/v/o (MLA: q, latent down-projection, kv_b absorbed into query and output, o), every layer.

    Absorbed MLA multiplies each query token by W_UK and each output by W_UV: the same FLOPs as
    running kv_b_proj over the query tokens, never over the context.
    """
    flops, nbytes = linears_cost(dep, dep.shape.attention_linears(), tokens)
    return dep.shape.num_layers * flops, dep.shape.num_layers * nbytes


def mlp(dep: Deployment, tokens: int) -> tuple[float, float]:
    """Dense SwiGLU layers, plus MoE layers: the experts each token uses, the bytes of all touched."""
    shape = dep.shape
    flops, nbytes = linears_cost(dep, shape.dense_mlp_linears(), tokens)
    dense = shape.num_layers - shape.num_moe_layers
    flops, nbytes = dense * flops, dense * nbytes
    if shape.moe is None:
        return flops, nbytes
    m = shape.moe
    expert_flops, expert_bytes = linears_cost(dep, shape.expert_linears(), tokens)
    router_flops, router_bytes = linears_cost(dep, [shape.router()], tokens)
    per_layer_flops = (m.num_shared_experts + m.experts_per_token) * expert_flops + router_flops
    per_layer_bytes = (m.num_shared_experts + experts_touched(m.num_routed_experts, m.experts_per_token, tokens)
                       ) * expert_bytes + router_bytes
    return flops + shape.num_moe_layers * per_layer_flops, nbytes + shape.num_moe_layers * per_layer_bytes


def experts_touched(num_experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens route to, each picking `per_token` uniformly."""
    return num_experts * (1 - (1 - per_token / num_experts) ** tokens)


def attention(dep: Deployment, items: list[BatchItem]) -> tuple[float, float]:
    """QK^T and PV over each row's causal context; the cache read once per row, new tokens written."""
    c = dep.shape.config
    heads = c.num_attention_heads // dep.tp
    if c.mla is None:
        flops_per_key = 2 * c.head_dim + 2 * c.head_dim  # QK^T, then PV
    else:  # absorbed: keys are [latent | rope key], values the latent, one shared "head"
        flops_per_key = 2 * (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) + 2 * c.mla.kv_lora_rank
    pairs = sum(x.keys_attended for x in items)
    flops = c.num_hidden_layers * heads * flops_per_key * pairs
    cache_tokens = sum(x.context_len + x.num_query_tokens for x in items)  # read the context, write the new
    return flops, cache_tokens * dep.kv_bytes_per_token


def lm_head(dep: Deployment, rows: int) -> tuple[float, float]:
    """Logits of the sampling rows only (vocab split across ranks); no read when no row samples."""
    return linears_cost(dep, [dep.shape.lm_head()], rows) if rows else (0.0, 0.0)


def link_costs(dep: Deployment, tokens: int) -> list[OpCost]:
    """What the ranks' link costs an iteration: its all-reduces, and handing the step to the other ranks
    where the link says that costs anything (a local link, measured)."""
    link = dep.hardware.link
    assert link is not None  # check_tp refuses tp > 1 without a link
    costs = [all_reduces(dep, tokens)]
    if link.step_post_s:
        costs.append(OpCost("step_post", 0.0, 0.0, link.step_post_s, "link"))
    return costs


def all_reduces(dep: Deployment, tokens: int) -> OpCost:
    """Two ring all-reduces of the hidden state per layer."""
    link = dep.hardware.link
    assert link is not None
    sent = ring_bytes_sent(tokens * dep.shape.config.hidden_size * DTYPE_BYTES[dep.dtype], dep.tp)
    count = ALL_REDUCES_PER_LAYER * dep.shape.num_layers
    return OpCost("all_reduce", 0.0, 0.0, count * (sent / link.bandwidth + link.latency_s), "link", count * sent)


def resident_bytes(dep: Deployment) -> float:
    """One rank's weights in memory: every expert, the embedding in the activation dtype (quant.py keeps it)."""
    return model_bytes(dep.shape, dep.weight_quant, dep.quant_group_size, dep.tp)


def embedding_bytes(shape: ModelShape) -> float:
    """The token embedding's bytes, whole (the cost model's ranks split it by vocabulary; kvscope's keep it)."""
    return shape.config.vocab_size * shape.config.hidden_size * DTYPE_BYTES[shape.dtype]


def model_bytes(shape: ModelShape, weight_quant: str = "none", quant_group_size: int = 64, tp: int = 1) -> float:
    """resident_bytes without a GPU: what one rank of the shape's weights takes, stored as asked (the
    server sizes a weight copy by it before building one)."""
    c = shape.config

    def weight(w: Linear) -> float:
        return rank_bytes(w, shape.dtype, weight_quant, quant_group_size, tp)

    total = shape.num_layers * sum(weight(w) for w in shape.attention_linears())
    total += (shape.num_layers - shape.num_moe_layers) * sum(weight(w) for w in shape.dense_mlp_linears())
    if shape.moe is not None:
        experts = shape.moe.num_shared_experts + shape.moe.num_routed_experts
        total += shape.num_moe_layers * (experts * sum(weight(w) for w in shape.expert_linears())
                                         + weight(shape.router()))
    embedding = embedding_bytes(shape) / tp
    # Tied and quantized: lm_head has its own quantized copy beside the embedding (quant.py).
    lm_head_separate = not c.tie_word_embeddings or weight_quant != "none"
    return total + embedding + (weight(shape.lm_head()) if lm_head_separate else 0.0)
