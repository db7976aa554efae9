"""Block table of the selected request: logical block -> physical block, fill, sharing."""

from __future__ import annotations

import html


from kvscope.backend.events.state import RunState
from kvscope.frontend.client import RunFeed
from kvscope.backend.events.history import RunHistory
from kvscope.frontend.selection import Selection
from kvscope.frontend.palette import CHIP_COLORS, request_color
from kvscope.frontend.views.base import FeedView, legend, view_card
from kvscope.frontend.views.live_text import LiveText

EXPLANATION = """
A sequence sees its KV cache as consecutive **logical** blocks 0, 1, 2, ...; its **block table** maps
each to a **physical** block anywhere in the pool (the numbers in the block pool). Attention
kernels follow this table to find a token's keys and values, which is why the blocks of one request
need not be contiguous. Only the last block is partly filled; a block marked **shared** is read by
several sequences (a cached prefix or a fork) and is copied before anyone writes into it
(copy-on-write). With n > 1 or beam search a request has several sequences, forked from one
another; with a draft model, the draft keeps its own, smaller KV in a sequence of its own.
"""

LEGEND = [(request_color(0), "L → physical block (colour = request)"),
          (f"transparent;box-shadow:0 0 0 2px {CHIP_COLORS['shared']}", "ring: shared ×n (ref count)"),
          (CHIP_COLORS["fill"], "n/size: the last block's fill")]


def table_html(state: RunState, history: RunHistory, request_id: str | None, current: int | None = None) -> str:
    """One row of chips per sequence of the request; `current`: the selected sequence, marked."""
    if request_id is None or request_id not in state.requests:
        return '<div class="kv-muted">No request selected.</div>'
    seqs = sorted(s for s, r in state.seq_request.items() if r == request_id and s in state.block_tables)
    view = state.requests[request_id]
    if not seqs:
        return f'<div class="kv-muted">{html.escape(request_id)} holds no blocks ({view.status}).</div>'
    bs = state.cache.get("block_size", 1)
    color = request_color(history.rows.get(request_id, 0))
    return "".join(_seq_row(state, history, seq, bs, color, seq == current and len(seqs) > 1) for seq in seqs)


def _seq_row(state: RunState, history: RunHistory, seq: int, bs: int, color: str, current: bool) -> str:
    table = state.block_tables[seq]
    tokens = history.seq_context.get(seq, 0)
    chips = []
    for logical, block in enumerate(table):
        filled = min(bs, max(0, tokens - logical * bs))
        shared = state.ref_counts.get(block, 1) > 1
        badge = f'<span class="kv-chip-badge">shared ×{state.ref_counts[block]}</span>' if shared else ""
        fill = f'<span class="kv-chip-fill">{filled}/{bs}</span>' if logical == len(table) - 1 else ""
        chips.append(
            f'<div class="kv-chip{" kv-chip-shared" if shared else ""}" style="border-color:{color}">'
            f'<span class="kv-chip-logical">L{logical}</span><span class="kv-chip-arrow">→</span>'
            f'<span class="kv-chip-physical" style="background:{color}">{block}</span>{fill}{badge}</div>'
        )
    head = f'<div class="kv-seq-head">seq {seq}{seq_role(state, seq)} · {tokens} tokens in {len(table)} blocks</div>'
    return f'<div class="kv-seq{" kv-seq-current" if current else ""}">{head}<div class="kv-chips">{"".join(chips)}</div></div>'


def seq_role(state: RunState, seq: int) -> str:
    """What a sequence is to its request: the draft model's, a fork, or ended while others go on."""
    if seq in state.draft_seqs:
        return f" · draft model for seq {state.draft_seqs[seq]}"
    view = state.sequences.get(seq)
    if view is None:
        return ""
    forked = view.parent_seq_id is not None
    fork = f" · forked from seq {view.parent_seq_id} at token {view.position}" if forked else ""
    return fork + (f" · ended ({view.end_reason})" if view.end_reason else "")


class BlockTableView(FeedView):
    name = "block_table"

    def __init__(self, feed: RunFeed, selection: Selection) -> None:
        self.selection = selection
        with view_card("Block table of the selected request", EXPLANATION, "w-full"):
            legend(LEGEND)
            self.html = LiveText(html=True).classes("w-full").mark("block-table")
        self.last = ""
        selection.on_change(self.invalidate)
        super().__init__(feed)

    def full(self) -> bool:
        state = self.feed.state
        content = table_html(state, self.feed.history, self.selection.current(state), self.selection.sequence(state))
        if content == self.last:
            return False
        self.last = content
        self.html.set(content)
        return True

    def delta(self, entries) -> bool:
        return self.full()  # a few chips: recomputing is cheaper than tracking what changed
