"""What a block size costs, drawn for a compare pair that differs in it: block-table entries, prefix-cache
hashes and paged-attention block gathers, one bar per run.

A block of 1 token wastes no slot, but every block is a table entry, a hash and a lookup: the pool view
shows the memory (the same bytes either way), this figure the bookkeeping. The counts are
backend/events/compare.py's `block_costs`, from each run's iterations.
"""

from __future__ import annotations

from nicegui import ui

from kvscope.backend.events.compare import BlockCosts, block_costs
from kvscope.backend.events.record import RunRecord
from kvscope.frontend.views.base import view_card
from kvscope.frontend.views.charts import make_chart

BARS = ("block-table entries (peak)", "prefix-cache hashes", "block gathers (decode)")
SIDE_COLOURS = ("#4e79a7", "#f28e2b")  # the left run, the right run
BAR_LABEL = {"show": True, "position": "top"}  # the counts in figures: 16x apart, the short bar is hard to read
EXPLANATION = """**Why tiny blocks cost.** Each block is one entry in its sequence's block table, one chained hash
when prefix caching fills it, and one lookup each time paged attention gathers a sequence's keys and
values. With 1-token blocks a context of n tokens is n of each; with 16-token blocks n / 16."""
CAPTION = ("Counted from each run's iterations, a request holding ⌈context / block size⌉ blocks. "
           "Block-table entries: the most block ids the scheduled requests' tables held in one iteration. "
           "Prefix-cache hashes: every full block (⌊context / block size⌋ per request) is hashed once, as it "
           "fills. Block gathers: the blocks paged attention looked up, summed over every decode row of the run.")


def block_sizes_differ(a: RunRecord, b: RunRecord) -> bool:
    sizes = [r.state.cache.get("block_size") for r in (a, b)]
    return None not in sizes and sizes[0] != sizes[1]


def hashes_text(costs: BlockCosts, title: str) -> str:
    """What the hash bar of one run stands for (nothing is hashed with prefix caching off)."""
    if costs.hashed_blocks is None:
        return f"{title}: prefix caching is off, no block is hashed"
    return f"{title}: {costs.hashed_blocks:,} blocks hashed"


class BlockCostFigure:
    """The card after the row of differences; shown only while the two runs' block sizes differ."""

    def __init__(self) -> None:
        self.card = view_card("What the block size costs", EXPLANATION, "w-full kv-side-block-cost")
        with self.card:
            self.chart = make_chart({
                "tooltip": {"trigger": "axis"}, "legend": {"top": 0},
                "grid": {"left": 70, "right": 16, "top": 44, "bottom": 28},
                "xAxis": {"type": "category", "data": list(BARS)},
                "yAxis": {"type": "value", "name": "count"},
                "series": [],
            }, "220px", "block-cost")
            self.hashes = ui.label("").classes("kv-caption").props("data-kv=block-cost-hashes")
            ui.label(CAPTION).classes("kv-caption")
        self.card.set_visibility(False)
        self.shown: tuple = ()

    def show(self, records: tuple[RunRecord, RunRecord], titles: tuple[str, str]) -> None:
        """Draw both runs' counts (only when they changed), or hide the card when the block sizes agree."""
        differ = block_sizes_differ(*records)
        if self.card.visible != differ:
            self.card.set_visibility(differ)
        if not differ:
            return
        costs = [block_costs(r) for r in records]
        if self.shown == (costs, titles):
            return
        self.shown = (costs, titles)
        series = [{"name": title, "type": "bar", "itemStyle": {"color": colour}, "label": BAR_LABEL,
                   "data": [c.table_entries, c.hashed_blocks, c.gathers]}
                  for c, title, colour in zip(costs, titles, SIDE_COLOURS)]
        self.chart.run_chart_method("setOption", {"series": series})
        self.hashes.set_text(" · ".join(hashes_text(c, t) for c, t in zip(costs, titles)))
