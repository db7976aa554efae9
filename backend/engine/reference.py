"""The plain reference: generation by recomputing the whole sequence at every token, no cache.

Slow on purpose and obviously correct: the engine's output is checked against it token for token.
"""

from __future__ import annotations

import torch

from kvscope.backend.engine.grammar import Matcher
from kvscope.backend.engine.sampler import sample, uniform
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.model.attention import DenseCausalBackend
from kvscope.backend.model.transformer import CausalLM


@torch.no_grad()
def next_token_logits(model: CausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits [vocab] for the token after `token_ids`, from a full forward pass."""
    ids = torch.tensor(token_ids, device=model.device)
    hidden = model(ids, torch.arange(len(token_ids), device=model.device), DenseCausalBackend())
    return model.logits(hidden[-1])


def reference_generate(model: CausalLM, prompt_ids: list[int], max_tokens: int,
                       params: SamplingParams | None = None, eos_ids: list[int] | None = None,
                       matcher: Matcher | None = None) -> list[int]:
    """Generate up to max_tokens ids after the prompt; stops after EOS or a stop token id.

    matcher: a grammar (structured outputs) at its start; each token is drawn under its mask and
    advances it, and the grammar's end stops generation, as in the engine."""
    params = params or SamplingParams(temperature=0.0)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids or []))
    gen = torch.Generator().manual_seed(params.seed or 0)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = next_token_logits(model, prompt_ids + out)[None]
        mask = matcher.masks([]) if matcher else None
        token = sample(logits, [params], [uniform(gen)], eos_ids or [], [prompt_ids + out], [len(prompt_ids)],
                       mask).token_ids[0]
        out.append(token)
        if matcher:
            matcher.accept(token)
        if token in stops or (matcher and matcher.terminated):
            break
    return out
