"""A request as the engine tracks it, and the rules that refuse or finish one."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.beam_search import BeamState
from kvscope.backend.engine.metrics import RequestTimes
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.sequence import Sequence
from kvscope.backend.errors import KvscopeError
from kvscope.backend.model.tokenizer import Tokenizer


class RequestError(KvscopeError):
    """A request refused at submission: which field, and why."""


@dataclass(eq=False)  # identity: a request is found in lists by who it is
class Request:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int
    params: SamplingParams
    seed: int
    arrival_step: int
    times: RequestTimes
    seq: Sequence  # the first sequence: the only one unless n > 1 or beam search forks more
    seqs: list[Sequence] = field(default_factory=list)  # every sequence of the request, in fork order
    streams: dict[int, int] = field(default_factory=dict)  # seq_id -> its random stream (fork order)
    generators: list[torch.Generator] = field(default_factory=list)  # by stream, made when first drawn from
    cumulative_logprob: dict[int, float] = field(default_factory=dict)  # seq_id -> sum of its tokens' logprobs
    seq_finish: dict[int, str] = field(default_factory=dict)  # seq_id -> why it ended
    stop_texts: dict[int, str] = field(default_factory=dict)  # seq_id -> output cut before a stop string
    beam: BeamState | None = None
    finish_reason: str | None = None
    abort_reason: str | None = None
    output_text: str = ""
    outputs: list[dict] = field(default_factory=list)  # set when it ends: every returned sequence, best first
    draft_generator: torch.Generator | None = None  # speculative drafts draw from their own stream

    def __post_init__(self) -> None:
        self.seqs = [self.seq]
        self.add_stream(self.seq)

    def add_stream(self, seq: Sequence) -> None:
        """Give a new sequence its own random stream (the next in fork order) and a zero cumulative log-prob."""
        self.streams[seq.seq_id] = len(self.streams)
        self.cumulative_logprob[seq.seq_id] = 0.0

    def generator(self, stream: int) -> torch.Generator:
        """Stream i's generator: n > 1 draws a first token from streams 0..n-1 before the siblings exist."""
        while len(self.generators) <= stream:  # stream 0 keeps the plain seed: n = 1 draws what it always drew
            self.generators.append(torch.Generator().manual_seed(
                (self.seed + len(self.generators) * 0x9E3779B97F4A7C15) % 2**63))
        return self.generators[stream]

    @property
    def multi(self) -> bool:
        """Whether the request has (or will have) several sequences."""
        return self.params.n > 1 or self.beam is not None

    def output_text_of(self, seq: Sequence, tokenizer: Tokenizer, eos_ids: list[int]) -> str:
        if seq.seq_id in self.stop_texts:
            return self.stop_texts[seq.seq_id]
        return tokenizer.decode([t for t in seq.output_token_ids if t not in eos_ids])


def check_fits(config: EngineConfig, num_blocks: int, prompt_len: int, max_tokens: int) -> None:
    """Refuse a request that this engine configuration could never serve."""
    if prompt_len == 0:
        raise RequestError("prompt", "empty prompt")
    if max_tokens < 1:
        raise RequestError("max_tokens", "must be at least 1")
    if prompt_len >= config.max_model_len:
        raise RequestError("prompt", f"{prompt_len} tokens leave no room under max_model_len={config.max_model_len}")
    bs = config.block_size
    reserve = config.max_model_len if config.kv_layout == "contiguous" else prompt_len + 1
    if math.ceil(reserve / bs) > num_blocks:
        what = f"kv_layout contiguous reserves {reserve} slots" if config.kv_layout == "contiguous" \
            else f"{prompt_len} tokens need {math.ceil(reserve / bs)} blocks"
        raise RequestError("prompt", f"{what}; the whole cache has {num_blocks} blocks of {bs}")
    budget = config.max_num_batched_tokens
    if not config.kv_cache and prompt_len + max_tokens > budget:
        raise RequestError("max_tokens", f"without a KV cache the whole sequence ({prompt_len} + {max_tokens} "
                                         f"tokens) must fit max_num_batched_tokens={budget}")
    if not config.chunked_prefill and prompt_len > budget:
        raise RequestError("prompt", f"{prompt_len} tokens exceed max_num_batched_tokens={budget} "
                                     "and chunked_prefill is off")


def check_supported(params: SamplingParams, config: EngineConfig) -> None:
    """Refuse sampling settings this engine configuration cannot honour."""
    if params.structured_outputs is not None and params.allowed_token_ids is not None:
        # Two hard masks may leave no token at all, and a grammar cannot end where nothing may follow.
        raise RequestError("sampling.allowed_token_ids", "cannot be combined with structured_outputs: the grammar "
                                                         "already decides which tokens may come next")
    if params.beam_width > 0:
        if params.structured_outputs is not None:
            raise RequestError("sampling.structured_outputs", "beam search ranks whole hypotheses, it cannot "
                                                              "follow a grammar: use n > 1 with sampling instead")
        if config.speculative is not None:
            raise RequestError("sampling.beam_width", "beam search ranks every candidate, it does not sample: "
                                                      "it cannot run with speculative decoding")
        if params.n > params.beam_width:
            raise RequestError("sampling.n", f"beam search returns at most beam_width={params.beam_width} "
                                             f"sequences, n={params.n} asked")


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse sampling settings naming a token outside the vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"sampling.{name}", f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    """Refuse a prompt of token ids naming a token outside the vocabulary (before any forward pass reads it)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def finish_reason_after(req: Request, seq: Sequence, token: int, eos_ids: list[int], max_model_len: int,
                        tokenizer: Tokenizer) -> str | None:
    """Why the sequence stops after `token` was appended, or None to go on."""
    p = req.params
    if token in eos_ids and not p.ignore_eos:
        return "eos"
    if token in p.stop_token_ids:
        return "stop"
    if p.stop and _cut_at_stop_string(req, seq, eos_ids, tokenizer):
        return "stop"
    if len(seq.output_token_ids) >= req.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None


def _cut_at_stop_string(req: Request, seq: Sequence, eos_ids: list[int], tokenizer: Tokenizer) -> bool:
    """Whether a stop string has appeared; if so the text is cut before it (it is not returned).

    Checked after every token, so a new occurrence must end in the newest token: decoding a tail of
    tokens that surely holds the longest stop string (a character is at most 4 bytes, a token at
    least 1, plus a few for a character cut at the tail's start) keeps the check O(1) per token.
    """
    start = max(seq.num_prompt_tokens, len(seq) - 4 * max(map(len, req.params.stop)) - 4)
    tail = tokenizer.decode([t for t in seq.token_ids[start:] if t not in eos_ids])
    if not any(s in tail for s in req.params.stop):
        return False
    text = tokenizer.decode([t for t in seq.output_token_ids if t not in eos_ids])
    req.stop_texts[seq.seq_id] = text[: min(i for i in (text.find(s) for s in req.params.stop) if i >= 0)]
    return True
