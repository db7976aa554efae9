"""Every colour that means something, in one place: phases, requests, block states, block events; and
the words the timeline's legend and tooltips both name a phase by.

Plain data (hex strings) read by the live views (which hand it to their JavaScript) and by the
exports (matplotlib), so a picture and the page it came from say the same thing in the same colour.
Phase colours are reserved: the request palette avoids their hues, so a request's colour never
reads as a phase and a phase never reads as a request.
"""

from __future__ import annotations

from kvscope.backend.events.history import KINDS
from kvscope.backend.phase import SHOWN_PHASES

RECOMPUTE_COLOR = "#8f2d2d"  # context computed again: the hatch over a preempted stretch, a step without KV cache
# What a request is doing in an iteration (the timeline's cells, the batch chart's legend).
PHASE_COLORS = {
    "waiting": "#d6dae1",  # grey: queued
    "prefill": "#f28e2b",  # orange
    "decode": "#4e79a7",  # blue
    "verify": "#b07aa1",  # purple: speculative decoding's k + 1 tokens
    "preempted": "#e15759",  # red: blocks taken back, waits to recompute
    "recompute": RECOMPUTE_COLOR,  # dark red: no KV cache, a decode step computes the whole context again
}
# What the timeline calls each kind of cell, in its legend's reading order; its tooltips say the same
# (for_js sends them), so a cell and the legend entry of its colour never disagree.
KIND_LABELS = {"waiting": "waiting", "prefill": "prefill (chunk)", "decode": "decode",
               "verify": "verify (speculative)", "preempted": "preempted (waits to recompute)",
               "recompute": "recompute (no KV cache: the whole context again)"}
BUDGET_COLOR = "#111827"  # the token budget line (max_num_batched_tokens)
# Tensor parallelism: the time a step spent in its all-reduces (the timeline's band above the requests).
ALLREDUCE_COLOR = "#334155"

# Requests, by arrival order: greens, teals, yellows, browns and a magenta, each far (CIELAB
# distance >= 25) from every phase and block-state colour, so none reads as one of them.
# Adjacent entries differ in hue and lightness.
REQUEST_COLORS = (
    "#59a14f", "#17becf", "#edc948", "#9c755f", "#e377c2", "#499894", "#bcbd22", "#8cd17d",
    "#b6992d", "#637939", "#2ca02c", "#8c6d31", "#dbdb8d", "#f1ce63",
)  # fmt: skip
MANY_REQUESTS_COLOR = "#9aa5b1"  # one batch segment standing for many decoding requests

# The block pool: a block is free, free but still holding a cached prefix, or a request's colour.
BLOCK_COLORS = {"free": "#eef1f5", "cached": "#bfe3d4", "shared": "#111827"}
# What no request may look like.
RESERVED = frozenset({*PHASE_COLORS.values(), RECOMPUTE_COLOR, BUDGET_COLOR, ALLREDUCE_COLOR, *BLOCK_COLORS.values()})
# Rings that flash on a block when an event touches it.
FLASH_COLORS = {"alloc": "#16a34a", "share": "#9333ea", "copy": "#f59e0b", "free": "#475569", "evict": "#dc2626",
                "move": "#0891b2"}
FLASH_LABELS = {"alloc": "allocate", "share": "share", "copy": "copy-on-write", "free": "free", "evict": "evict",
                "move": "moved between instances"}
TRANSFER_COLOR = FLASH_COLORS["move"]  # a disaggregated run's KV moving: the pools' rings, the timeline's marks
FOCUS_COLOR = "#111827"  # lesson mode's lasting ring (with a white inner line) on the blocks it explains
# ... in the colour of what the moment did to them, as its flash ring was (and its lesson text names it)
MOMENT_RING_FLASH = {"copy_on_write": "copy", "share": "share", "prefix_hit": "share", "fork": "share",
                     "preempt": "free", "cache_full": "free", "prune": "free", "block_added": "alloc",
                     "prompt_cached": "alloc", "prefill_chunk": "alloc", "slot_refilled": "alloc",
                     "kv_transfer": "move"}
# The attention mask: a key read from the KV cache (what decode does), one computed in this pass
# (what prefill does), one masked as the future.
MASK_COLORS = {"cached": PHASE_COLORS["decode"], "computed": PHASE_COLORS["prefill"], "masked": "#eceff3"}
# Batch slots (max_num_seqs): holding a sequence, or idle.
SLOT_COLORS = {"used": "#6b7280", "idle": "#fde2e2", "idle_edge": "#e8a0a0"}
# The block table's chips: the ring of a shared block and the last block's fill (static/kvscope.css
# .kv-chip-shared and .kv-chip-fill draw them).
CHIP_COLORS = {"shared": FLASH_COLORS["share"], "fill": "#fef3c7"}
# The sampling panel's token axis: the chosen token and end-of-sequence tokens.
TOKEN_MARK_COLORS = {"chosen": "#d62728", "eos": "#8c564b", "masked": "#7f7f7f"}
# A drafted token's fate in the speculative rows (static/kvscope.css .kv-tok-acc and the rest).
SPEC_COLORS = {"accepted": "#59a14f", "rejected": "#e15759", "discarded": "#cbd5e1", "resampled": "#f28e2b",
               "bonus": "#4e79a7"}


def request_color(index: int) -> str:
    """The colour of the request that arrived index-th (the palette repeats after its length)."""
    return REQUEST_COLORS[index % len(REQUEST_COLORS)]


def ring_color(moment_kind: str) -> str:
    """The lasting lesson ring's colour at a moment of this kind (block_pool.js draws it, exports too)."""
    flash = MOMENT_RING_FLASH.get(moment_kind)
    return FLASH_COLORS[flash] if flash else FOCUS_COLOR


def kind_colors() -> list[str]:
    """Phase colours in RunHistory's KINDS order: the index a timeline cell carries to the browser."""
    return [PHASE_COLORS[kind] for kind in KINDS]


def for_js() -> dict:
    """What the page's JavaScript draws with (window.KVSCOPE_COLORS)."""
    return {"requests": list(REQUEST_COLORS), "kinds": kind_colors(), "many": MANY_REQUESTS_COLOR,
            "budget": BUDGET_COLOR, "slots": SLOT_COLORS, "blocks": BLOCK_COLORS, "flash": FLASH_COLORS,
            "focus": FOCUS_COLOR, "allreduce": ALLREDUCE_COLOR, "transfer": TRANSFER_COLOR,
            "mask": MASK_COLORS, "kindNames": list(KINDS), "kindLabels": [KIND_LABELS[kind] for kind in KINDS],
            "phases": list(SHOWN_PHASES)}
