"""A request checked and prepared for the scheduler, or refused naming the field it cannot accept.

Nothing here holds state: the sampling settings are validated, the grammar compiled (or found in the
cache), the prompt tokenized and checked against the engine's limits. What passes becomes a
`NewRequest`, plain data the scheduler turns into a Request and its first Sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.grammar import Grammars, Matcher
from kvscope.backend.engine.request import (RequestError, check_fits, check_prompt_ids, check_supported,
                                            check_token_ids)
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.errors import validation_error
from kvscope.backend.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int
    params: SamplingParams
    matcher: Matcher | None  # its grammar's start (structured outputs)
    arrival: float  # when it was received, on the engine's clock


def prepare(request_id: str, prompt: str | list[int], max_tokens: int, sampling: SamplingParams | dict | None,
            config: EngineConfig, num_blocks: int, tokenizer: Tokenizer, grammars: Grammars,
            arrival: float, grammar: CompiledGrammar | None = None) -> NewRequest:
    """The request ready to queue, or RequestError naming the first field it cannot accept.

    grammar: its structured output already compiled (a server compiles a client's off the stepping
    thread, Grammars.compiled); else it is compiled here, or found in the cache."""
    params = parse_sampling(sampling)
    check_supported(params, config)
    check_token_ids(params, grammars.vocab_size)
    matcher = grammars.matcher(params.structured_outputs, grammar) if params.structured_outputs else None
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    check_prompt_ids(ids, grammars.vocab_size)
    check_fits(config, num_blocks, len(ids), max_tokens)
    text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    return NewRequest(request_id, ids, text, max_tokens, params, matcher, arrival)


def parse_sampling(sampling: SamplingParams | dict | None) -> SamplingParams:
    """A request's sampling settings, validated (RequestError naming the first bad field)."""
    if isinstance(sampling, SamplingParams):
        return sampling
    try:
        return SamplingParams.model_validate(sampling or {})
    except ValidationError as e:
        raise validation_error(e, "sampling", RequestError) from None
