"""The event schema (docs/events.md says what each event means): one pydantic model per event type and
their tagged union.

Producers build plain dicts on the hot path (see bus.py); these models are for the edges: reading
traces, tests, `kvscope schema events`. Every model forbids fields it does not declare, so an event
is exactly what this file says: a producer that adds a field declares it here first.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kvscope.backend.phase import Phase

SCHEMA_VERSION = 1


class _Exact(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelInfo(_Exact):
    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    attention: Literal["mha", "gqa", "mqa", "mla"]
    vocab_size: int
    dtype: str
    kv_bytes_per_token: int
    eos_token_ids: list[int] | None = None
    config: dict[str, Any] | None = None  # the whole ModelConfig: what the cost model prices a replay by


class DraftModelInfo(_Exact):
    name: str
    n_layers: int
    kv_bytes_per_token: int
    bytes_per_block: int


class CacheInfo(_Exact):
    num_blocks: int
    block_size: int
    bytes_per_block: int
    dtype: str | None = None  # the KV cache's storage dtype (int8 when quantized)
    formula: dict[str, Any] | None = None  # how bytes_per_block was computed, for the UI to show


class SimulationInfo(_Exact):
    """Simulate mode (docs/perf_model.md): no weights ran; times are the cost model's, tokens a seeded stand-in."""

    model_shape: str
    hardware: str
    hardware_label: str
    tp: int
    link: str | None
    gpu_memory_utilization: float
    weights_bytes_per_gpu: float
    kv_pool_bytes_per_gpu: float  # memory x utilization - weights, what the block pool was sized from
    kv_bytes_per_token_per_gpu: float  # one rank's share of a token (KV heads split across ranks)
    peak_flops: float
    mem_bandwidth: float
    ridge: float  # FLOP per byte where the roofs meet
    stand_in_vocab: int  # token ids come from a seeded table over this many ids of the stand-in tokenizer


class BatchEntry(_Exact):
    request_id: str
    seq_id: int
    phase: Phase  # backend/phase.py
    num_query_tokens: int
    context_len: int
    num_draft_tokens: int | None = None  # verify only: drafted tokens checked in this pass
    instance: int | None = None  # a disaggregated run's: the instance that ran the row (header disaggregation)


class TokenDist(_Exact):
    top: list[tuple[int, str, float, float]]  # [token_id, text, raw_prob, final_prob]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    # under a grammar: the likeliest tokens its mask removed, [token_id, text, the model's prob before the mask]
    # (top's raw_prob is after the mask, renormalised over the tokens it allowed)
    masked: list[tuple[int, str, float]] | None = None
    # the whole raw row, base64 of little-endian float32 [vocab_size], for the tokens a run records it for
    # (each sequence's first, a grammar's forced ones: backend/engine/dist_rows.py RecordedRows)
    raw_probs_f32: str | None = None


class SpecResult(_Exact):
    token_id: int
    p: float  # target's final probability of the drafted token
    q: float  # the proposer's probability of it (1 for n-gram lookup)
    accepted: bool
    text: str | None = None


class SeqOutput(_Exact):
    """One sequence's result when a request has several (n > 1, beam search)."""

    seq_id: int
    output_token_ids: list[int]
    output_text: str
    finish_reason: str
    cumulative_logprob: float
    score: float | None = None  # beam search: cumulative logprob / length ** length_penalty


class _Event(_Exact):
    seq: int
    step: int
    t: float


class RankInfo(_Exact):
    """What one tensor-parallel rank holds: [start, end) of the heads, KV heads and MLP units, and bytes."""

    rank: int
    heads: list[int]
    kv_heads: list[int]
    intermediate: list[int]
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int  # its KV pool: every rank has num_blocks blocks of its own heads
    # where it ran: the machine's name and its collectives' address, "box (10.0.0.2)"; null in older traces
    host: str | None = None


class TensorParallelInfo(_Exact):
    size: int
    backend: Literal["gloo", "nccl"]
    launcher: Literal["spawn", "torchrun"]
    timeout_s: float
    embedding: str  # "replicated"
    lm_head: str  # "rank 0": only rank 0 computes logits
    kv_heads_replicated: bool  # fewer KV heads than ranks: each is held by world / n_kv_heads ranks
    ranks: list[RankInfo]


class AllReduceInfo(_Exact):
    """One iteration's all-reduces: how many, the bytes each rank sent in, rank 0's time in them."""

    count: int
    bytes: int
    ms: float


class InstanceInfo(_Exact):
    """One instance of a disaggregated run: its role and its blocks, numbered [first_block, first_block +
    num_blocks) in every block event (each instance's pool is its own; the events number them apart)."""

    instance: int
    role: Literal["prefill", "decode"]
    first_block: int
    num_blocks: int


class DisaggregationInfo(_Exact):
    prefill_instances: int
    decode_instances: int
    router: Literal["round_robin", "least_loaded"]
    link: str  # what carries the blocks: "gloo (127.0.0.1)"
    instances: list[InstanceInfo]


class InstanceStep(_Exact):
    """One instance's share of a disaggregated iteration, timed on its own clock."""

    instance: int
    num_batched_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    duration_s: float


class HeaderEvent(_Event):
    type: Literal["header"]
    schema_version: int
    run_id: str
    scenario: dict[str, Any] | None
    config: dict[str, Any]
    model: ModelInfo
    cache: CacheInfo
    # {quant, group_size, layers, bytes, bytes_unquantized}; a GGUF file run natively adds gguf and lm_head
    # (docs/quantization.md)
    weights: dict[str, Any] | None = None
    attention_backend: str | None = None  # which attention implementation ran (torch, triton, ...)
    device: str | None = None
    draft_model: DraftModelInfo | None = None  # speculative decoding with a draft model
    simulated: SimulationInfo | None = None  # simulate mode: modelled time, stand-in tokens
    tensor_parallel: TensorParallelInfo | None = None  # the model sharded over ranks (docs/engine.md)
    disaggregation: DisaggregationInfo | None = None  # prefill and decode on instances of their own


class RequestArrivedEvent(_Event):
    type: Literal["request_arrived"]
    request_id: str
    seq_id: int  # its first sequence; more come as seq_fork events (n > 1, beam search)
    prompt_token_ids: list[int]
    prompt_text: str
    sampling: dict[str, Any]
    max_tokens: int


class RequestRejectedEvent(_Event):
    """A request refused at submission; request_id is null when it never got one."""

    type: Literal["request_rejected"]
    request_id: str | None
    field: str
    reason: str


class IterationEvent(_Event):
    type: Literal["iteration"]
    batch: list[BatchEntry]
    num_batched_tokens: int
    token_budget: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    duration_s: float
    # The executor's part of duration_s (the step's inputs, the forward, sampling); the rest is the
    # scheduler's. Measured, as duration_s is; None in traces older than it.
    execute_s: float | None = None
    max_num_seqs: int  # the batch's slot count, for the idle-slot view
    # Simulate mode only (duration_s is then the modelled time): the iteration's FLOPs per byte of
    # memory traffic, and which roof it sits under (the cost model's IterationCost).
    intensity: float | None = None
    bound: Literal["memory", "compute"] | None = None
    allreduce: AllReduceInfo | None = None  # a tensor-parallel run's, measured on rank 0
    # A disaggregated run's instances, each timed on its own clock; duration_s is then the longest of them
    # (they run side by side) and the counts are their sums.
    instances: list[InstanceStep] | None = None


class KVTransferEvent(_Event):
    """A disaggregated run moved a prefilled request's blocks from a prefill instance to a decode instance."""

    type: Literal["kv_transfer"]
    request_id: str
    seq_ids: list[int]
    src_instance: int
    dst_instance: int
    src_blocks: list[int]  # as the block events number them
    dst_blocks: list[int]  # dst_blocks[i] received src_blocks[i]'s contents
    bytes: int
    link_s: float  # measured: the send of the table and the contents until the last byte was received


class BlockAllocEvent(_Event):
    type: Literal["block_alloc"]
    block_id: int
    seq_id: int
    request_id: str
    logical_index: int


class BlockFreeEvent(_Event):
    type: Literal["block_free"]
    block_id: int
    seq_id: int
    request_id: str
    cached: bool


class BlockShareEvent(_Event):
    type: Literal["block_share"]
    block_id: int
    seq_id: int
    request_id: str
    logical_index: int
    ref_count: int
    reason: Literal["prefix_cache", "fork", "transfer"]


class BlockCopyEvent(_Event):
    type: Literal["block_copy"]
    src_block_id: int
    dst_block_id: int
    seq_id: int


class BlockEvictEvent(_Event):
    type: Literal["block_evict"]
    block_id: int


class AttentionMaskEvent(_Event):
    type: Literal["attention_mask"]
    request_id: str
    seq_id: int
    kind: Literal["prefill", "chunked_prefill", "decode", "verify"]
    query_positions: tuple[int, int]  # [start, end)
    key_len: int


class TokenEvent(_Event):
    type: Literal["token"]
    request_id: str
    seq_id: int
    position: int
    token_id: int
    text: str
    logprob: float
    source: Literal["target", "draft_accepted", "resampled", "bonus"]
    dist: TokenDist | None = None  # dropped at events level "summary"
    top_logprobs: list[tuple[int, str, float]] | None = None  # [token_id, text, logprob]; sampling.logprobs > 0
    # structured outputs: tokens the grammar allowed here, and the raw (T=1) probability mass it removed
    num_allowed: int | None = None
    masked_mass: float | None = None


class SpecProposeEvent(_Event):
    type: Literal["spec_propose"]
    request_id: str
    seq_id: int
    token_ids: list[int]
    q_probs: list[float]
    method: Literal["draft", "ngram"] | None = None
    draft_seq_id: int | None = None  # the draft model's own sequence (its blocks are in the pool)
    position: int | None = None  # position of the first drafted token
    token_texts: list[str] | None = None


class SpecVerifyEvent(_Event):
    type: Literal["spec_verify"]
    request_id: str
    seq_id: int
    results: list[SpecResult]
    num_accepted: int
    resampled_token_id: int | None
    bonus_token_id: int | None
    position: int | None = None  # position of the first drafted token
    # Per verified position (k + 1, the last one is the bonus position): [token_id, text, p, q]
    # for the top tokens of p and of q, for the dashboard's p-vs-q bars. Only at events level full.
    dists: list[list[tuple[int, str, float, float]]] | None = None
    expected_accept: list[float] | None = None  # sum_x min(p(x), q(x)) per drafted position


class SeqForkEvent(_Event):
    """A request's sequence branches (n > 1 after the prompt, or a beam kept twice)."""

    type: Literal["seq_fork"]
    request_id: str
    parent_seq_id: int
    seq_id: int
    position: int  # tokens the child inherits


class SeqEndEvent(_Event):
    """One sequence of a multi-sequence request ends (finished, or a beam pruned)."""

    type: Literal["seq_end"]
    request_id: str
    seq_id: int
    reason: Literal["eos", "stop", "length", "abort", "pruned"]


class PreemptEvent(_Event):
    type: Literal["preempt"]
    request_id: str
    seq_id: int
    num_blocks_freed: int
    mode: Literal["recompute"]


class RequestFinishedEvent(_Event):
    type: Literal["request_finished"]
    request_id: str
    seq_id: int | None = None  # the returned (best) sequence
    finish_reason: Literal["eos", "stop", "length", "abort"]
    output_token_ids: list[int]
    output_text: str
    ttft_s: float | None  # null when aborted before its first token
    tpot_s: float | None  # null with fewer than two output tokens
    e2e_s: float
    queue_s: float | None = None  # arrival to the first iteration that ran it; null when it never ran
    # a disaggregated run's: the link's time moving its blocks to a decode instance, part of ttft_s
    # (ttft_s = queue_s + prefill + transfer_s); absent when it never moved
    transfer_s: float | None = None
    reason: str | None = None  # why it was aborted
    outputs: list[SeqOutput] | None = None  # n > 1 or beam search: every returned sequence, best first
    num_cached_prompt_tokens: int | None = None  # prompt tokens found in the prefix cache


class MetricsEvent(_Event):
    type: Literal["metrics"]
    tokens_per_s: float
    kv_usage: float
    kv_waste: float  # reserved-but-unused slots / total slots
    prefix_hit_rate: float
    num_preemptions: int
    num_running: int | None = None
    num_waiting: int | None = None
    kv_blocks_saved_by_sharing: int | None = None  # table entries minus distinct blocks (forks, prefix hits)
    spec_acceptance_rate: float | None = None  # accepted / proposed draft tokens, speculative runs only
    spec_alpha: float | None = None  # mean sum_x min(p, q) over drafted positions
    spec_tokens_per_verify: float | None = None  # tokens appended per verify (accepted + 1)


class RunFinishedEvent(_Event):
    type: Literal["run_finished"]
    num_steps: int
    reason: str


class ErrorEvent(_Event):
    """Something went wrong on the server's side of a served run: the exception's type and a short reason
    (never a path or a traceback; those are in the server's log)."""

    type: Literal["error"]
    message: str
    fatal: bool  # true: the run failed and stopped; false: it goes on (e.g. without its trace file)


class ControlEvent(_Event):
    """pause / resume / step / speed, recorded so that replay shows them."""

    type: Literal["control"]
    action: str
    value: float | str | None = None


EVENT_MODELS: tuple[type[_Event], ...] = (
    HeaderEvent,
    RequestArrivedEvent,
    RequestRejectedEvent,
    IterationEvent,
    BlockAllocEvent,
    BlockFreeEvent,
    BlockShareEvent,
    BlockCopyEvent,
    BlockEvictEvent,
    AttentionMaskEvent,
    TokenEvent,
    SpecProposeEvent,
    SpecVerifyEvent,
    SeqForkEvent,
    SeqEndEvent,
    PreemptEvent,
    RequestFinishedEvent,
    KVTransferEvent,
    MetricsEvent,
    RunFinishedEvent,
    ErrorEvent,
    ControlEvent,
)
EVENT_TYPES: tuple[str, ...] = tuple(m.model_fields["type"].annotation.__args__[0] for m in EVENT_MODELS)

Event = Annotated[Union[EVENT_MODELS], Field(discriminator="type")]  # noqa: UP007
_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(data: dict[str, Any]) -> Event:
    """Validate one event dict; raises pydantic.ValidationError (see describe_error)."""
    return _ADAPTER.validate_python(data)


def describe_error(error: ValidationError) -> str:
    """One line a user can act on, from parse_event's ValidationError."""
    first = error.errors()[0]
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    if first["type"] == "union_tag_invalid":
        return f"unknown event type {first['ctx']['tag']!r}{more}"
    if first["type"] == "union_tag_not_found":
        return f"missing field 'type'{more}"
    if not first["loc"]:
        return f"{first['msg']}{more}"
    event_type, *path = first["loc"]
    where = ".".join(str(p) for p in path)
    if not where:
        return f"{event_type} event: {first['msg']}{more}"
    return f"{event_type} event: field {where!r}: {first['msg']}{more}"


def json_schema() -> dict[str, Any]:
    """The union's JSON Schema, printed by `kvscope schema events`."""
    return _ADAPTER.json_schema()
