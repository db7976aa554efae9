"""What a sequence does in an iteration: the one definition of a phase that the scheduler, the event
schema, the cost model, the views and the page's JavaScript (palette.for_js) all name.

prefill: prompt tokens (or a chunk of them) go into the cache; decode: one new token extends a
generating sequence; verify: the newest token plus speculative drafts, checked in one forward.
"""

from __future__ import annotations

from typing import Literal, get_args

Phase = Literal["prefill", "decode", "verify"]
PHASES: tuple[Phase, ...] = get_args(Phase)
# A display phase, never the engine's: without a KV cache a decode step computes the whole context
# again, and the views show it as what it is. The events still say "decode".
RECOMPUTE = "recompute"
SHOWN_PHASES: tuple[str, ...] = (*PHASES, RECOMPUTE)  # in the order the batch view sends their index to the page


def phase_of(num_tokens: int, num_drafts: int, reaches_end: bool, generating: bool, kv_cache: bool) -> Phase:
    """The one rule for a row's phase, for the target's rows and the draft model's alike.

    verify: the newest token plus drafts. decode: the step that extends an already generating
    sequence by its newest token (without a cache that step recomputes everything, but it is still the
    decode of one new token). prefill: anything else, a prompt or a chunk of it, or a sequence
    catching up on several tokens (after a preemption, or a draft model behind its target)."""
    if num_drafts:
        return "verify"
    if generating and reaches_end and (num_tokens == 1 or not kv_cache):
        return "decode"
    return "prefill"


def shown_phase(phase: Phase, kv_cache: bool) -> str:
    """The phase a view draws for an iteration's batch entry."""
    return RECOMPUTE if phase == "decode" and not kv_cache else phase
