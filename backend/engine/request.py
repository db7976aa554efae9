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


class RequestError(KvscopeError):
    """A request refused at submission: which field, and why."""


@dataclass(eq=False)  # identity: a request is found in lists by who it is
class Request:
    """Built by the scheduler at admission and written by it alone (tests/test_one_writer.py)."""

    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int
    params: SamplingParams
    seed: int
    arrival_step: int
    times: RequestTimes
    seq: Sequence  # the first sequence: the only one unless n > 1 or beam search forks more
    seqs: list[Sequence]  # every sequence of the request, in fork order
    streams: dict[int, int]  # seq_id -> its random stream (fork order)
    cumulative_logprob: dict[int, float]  # seq_id -> sum of its tokens' logprobs
    generators: list[torch.Generator] = field(default_factory=list)  # by stream; none when greedy or beams
    seq_finish: dict[int, str] = field(default_factory=dict)  # seq_id -> why it ended
    beam: BeamState | None = None
    finish_reason: str | None = None
    abort_reason: str | None = None
    error: str | None = None  # why one of its rows could not be sampled (it ended aborted, by its own fault)
    output_text: str = ""
    outputs: list[dict] = field(default_factory=list)  # set when it ends: every returned sequence, best first
    draft_generator: torch.Generator | None = None  # speculative drafts draw from their own stream

    @property
    def multi(self) -> bool:
        """Whether the request has (or will have) several sequences."""
        return self.params.n > 1 or self.beam is not None


def stream_generators(seed: int, params: SamplingParams) -> list[torch.Generator]:
    """One generator per random stream: n > 1 draws a first token from streams 0..n-1 before the siblings
    exist. Stream 0 keeps the plain seed, so n = 1 draws what it always drew. Greedy and beam search draw nothing."""
    if params.greedy or params.beam_width:
        return []
    return [torch.Generator().manual_seed((seed + i * 0x9E3779B97F4A7C15) % 2**63) for i in range(params.n)]


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


def finish_reason(params: SamplingParams, token: int, num_output: int, seq_len: int, max_tokens: int,
                  max_model_len: int, eos_ids: list[int], stopped_by_string: bool) -> str | None:
    """Why a sequence stops after `token` was appended (its output now num_output tokens long), or None to go on.
    stopped_by_string: a stop string appeared in its text (detokenizer.IncrementalText)."""
    if token in eos_ids and not params.ignore_eos:
        return "eos"
    if token in params.stop_token_ids or stopped_by_string:
        return "stop"
    if num_output >= max_tokens or seq_len >= max_model_len:
        return "length"
    return None
