"""A request as the engine tracks it, and the rules that refuse or finish one."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backend.config import EngineConfig
from backend.engine.metrics import RequestTimes
from backend.engine.sampling_params import SamplingParams
from backend.engine.sequence import Sequence
from backend.model.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request refused at submission: which field, and why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int
    params: SamplingParams
    generator: torch.Generator
    arrival_step: int
    times: RequestTimes
    seq: Sequence
    finish_reason: str | None = None
    abort_reason: str | None = None
    output_text: str = ""
    stop_hit: bool = False  # a stop string ended it: output_text is already cut
    draft_generator: torch.Generator | None = None  # speculative drafts draw from their own stream


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


def check_supported(params: SamplingParams) -> None:
    if params.n > 1:
        raise RequestError("sampling.n", "parallel sampling (n > 1) is not supported by this engine yet")
    if params.beam_width > 0:
        raise RequestError("sampling.beam_width", "beam search is not supported by this engine yet")


def finish_reason_after(req: Request, token: int, eos_ids: list[int], max_model_len: int,
                        tokenizer: Tokenizer) -> str | None:
    """Why the request stops after `token` was appended, or None to go on."""
    p = req.params
    if token in eos_ids and not p.ignore_eos:
        return "eos"
    if token in p.stop_token_ids:
        return "stop"
    if p.stop and _cut_at_stop_string(req, eos_ids, tokenizer):
        return "stop"
    if len(req.seq.output_token_ids) >= req.max_tokens or len(req.seq) >= max_model_len:
        return "length"
    return None


def _cut_at_stop_string(req: Request, eos_ids: list[int], tokenizer: Tokenizer) -> bool:
    """Whether a stop string has appeared; if so the text is cut before it (it is not returned)."""
    text = tokenizer.decode([t for t in req.seq.output_token_ids if t not in eos_ids])
    hits = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
    if not hits:
        return False
    req.output_text = text[: min(hits)]
    req.stop_hit = True
    return True
