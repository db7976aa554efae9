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


def shown_phase(phase: Phase, kv_cache: bool) -> str:
    """The phase a view draws for an iteration's batch entry."""
    return RECOMPUTE if phase == "decode" and not kv_cache else phase
