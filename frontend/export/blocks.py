"""The block pool picture: every KV block as a cell, coloured by the request owning it.

Only the rows of the grid that held a block at some time of the shown range are drawn (plus a row
of margin each side): a 2,048-block pool that a run used 40 blocks of is a few rows, not 32 rows of
empty cells. The columns are those that fill the slide best, the cells stretched a little to fill the
rest, so a small pool is large blocks, not a band across an empty slide. The row labels are the true
block ids, and a dashed line marks rows left out between. A tensor-parallel run gets a strip per rank,
titled as on the page. PoolGrid draws the grid once and `show`s the pool at any moment: the still calls
it once, the GIF once per frame; `ring` draws a lesson moment's rings.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from kvscope.backend.events.state import RunState
from kvscope.frontend.export.figure import MIN_TEXT_PT, SUBTITLE_PT, Size, frame, legend_outside, request_colors, \
    request_handles
from kvscope.frontend.export.options import SLIDE_SIZE
from kvscope.frontend.export.replayed import Event, ExportedRun
from kvscope.frontend.palette import BLOCK_COLORS

MARGIN_ROWS = 1
MIN_COLS = 4
MAX_STRETCH = 1.5  # how far a cell may depart from a square to fill the slide
MIN_ID_CELL_PX = 44  # block ids are written in cells at least this wide (12 pt ids fit)
SHARED_MARK_PX = 16
RING_MIN_PX = 4  # a lesson ring thinner than this is not seen from the back of a room


def used_blocks(events: list[Event]) -> set[int]:
    """Every block a sequence held at some time in these events (allocated, shared or copied into)."""
    used = {e["block_id"] for e in events if e["type"] in ("block_alloc", "block_share")}
    return used | {e["dst_block_id"] for e in events if e["type"] == "block_copy"}


@dataclass
class PoolLayout:
    cols: int
    rows: list[int]  # the grid rows drawn, ascending (row r holds blocks r * cols .. r * cols + cols - 1)
    num_blocks: int

    @property
    def total_rows(self) -> int:
        return math.ceil(self.num_blocks / self.cols)


def shown_rows(num_blocks: int, used: set[int], cols: int) -> list[int]:
    """The rows of a `cols`-wide grid holding a used block, with a margin row each side."""
    total = math.ceil(num_blocks / cols)
    held = {b // cols for b in used} or {0}
    return sorted({r + d for r in held for d in range(-MARGIN_ROWS, MARGIN_ROWS + 1) if 0 <= r + d < total})


def cell_shape(area_px: tuple[float, float], cols: int, rows: int) -> tuple[float, float]:
    """A cell's (width, height) in px when a cols × rows grid fills the area, each cell stretched from a
    square by no more than MAX_STRETCH: a short grid on a wide slide keeps blocks looking like blocks."""
    width, height = area_px[0] / cols, area_px[1] / rows
    return min(width, MAX_STRETCH * height), min(height, MAX_STRETCH * width)


def grid_fit(area_px: tuple[float, float], cols: int, rows: int) -> tuple[float, float]:
    """The share of the area the grid fills (in tenths: near enough is full), then a cell's size in px²."""
    width, height = cell_shape(area_px, cols, rows)
    return round(width * cols * height * rows / (area_px[0] * area_px[1]), 1), width * height


def pool_layout(num_blocks: int, used: set[int], area_px: tuple[float, float]) -> PoolLayout:
    """The grid that fills the most of `area_px` (width, height), with the largest cells among those that
    fill as much: its columns a power of two, so that row starts stay round ids."""
    widest = max(MIN_COLS, 1 << math.ceil(math.log2(max(num_blocks, 1))))
    candidates = [1 << k for k in range(int(math.log2(MIN_COLS)), int(math.log2(widest)) + 1)]
    rows = {cols: shown_rows(num_blocks, used, cols) for cols in candidates}
    cols = max(candidates, key=lambda c: grid_fit(area_px, c, len(rows[c])))
    return PoolLayout(cols, rows[cols], num_blocks)


@dataclass
class PoolCells:
    """The pool at one moment: each block's colour, the shared ones, and the counts a legend names."""

    colors: list[str]  # block id -> colour
    shared: list[int]
    per_request: Counter  # request -> blocks in use (each block counted for its earliest-arrived owner)
    free: int
    cached: int

    @property
    def in_use(self) -> int:
        return len(self.colors) - self.free - self.cached


def block_owners(state: RunState, order: list[str]) -> dict[int, str]:
    """In-use block -> the earliest-arrived request among its owners."""
    rank = {rid: i for i, rid in enumerate(order)}
    owners = {}
    for block, seqs in state.block_owner.items():
        rids = [state.seq_request[s] for s in seqs if s in state.seq_request]
        if rids:
            owners[block] = min(rids, key=lambda r: rank.get(r, len(rank)))
    return owners


def pool_cells(state: RunState, colors: dict[str, str], order: list[str]) -> PoolCells:
    owners = block_owners(state, order)
    cached = state.cached_blocks
    free = set(state.free_blocks) - cached
    cell = [BLOCK_COLORS["free"] if b in free else BLOCK_COLORS["cached"] if b in cached else
            colors.get(owners.get(b, ""), "black") for b in range(state.num_blocks)]
    shared = sorted(b for b, count in state.ref_counts.items() if count > 1)
    return PoolCells(cell, shared, Counter(owners.values()), len(free), len(cached))


@lru_cache(maxsize=256)
def _rgb(color: str) -> tuple[float, float, float]:
    return to_rgb(color)


def _ink(color: str) -> str:
    r, g, b = _rgb(color)
    return "#222222" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


class PoolGrid:
    """The grid's artists on `ax`; `show(cells)` recolours them. `area_px` is the room the grid gets
    (width, height): its cells stretch to fill it, within MAX_STRETCH (pool_layout chose the columns that
    fill it best), and it decides whether block ids fit in the cells; `ids=False` leaves them out (the GIF:
    each is a text to draw again in every frame, the costliest thing in it).

    A cell is a square of one PolyCollection: recolouring it per frame is one array, and Agg draws
    a few thousand squares faster than it resamples an image to the axes."""

    def __init__(self, ax: Axes, layout: PoolLayout, area_px: tuple[float, float], ids: bool = True) -> None:
        self.ax, self.layout, cols, rows = ax, layout, layout.cols, layout.rows
        # (x, y) of each shown block's cell, in shown-row order: y counts shown rows from the top
        self.blocks = [r * cols + c for r in rows for c in range(cols) if r * cols + c < layout.num_blocks]
        self.where = {b: ((b % cols), rows.index(b // cols)) for b in self.blocks}
        self.gap = 0.06 if cols <= 16 else 0.03  # white between cells
        self.cell_px = min(area_px[0] / cols, area_px[1] / len(rows))
        self.cells = ax.add_collection(PolyCollection([self._square(b, self.gap) for b in self.blocks], linewidths=0))
        self.labels = [ax.text(x, y + 0.3, str(b), ha="center", va="center", fontsize=MIN_TEXT_PT)
                       for b, (x, y) in self.where.items()] if ids and self.cell_px >= MIN_ID_CELL_PX else []
        self.marks = ax.scatter([], [], s=(SHARED_MARK_PX * 0.72) ** 2, color=BLOCK_COLORS["shared"],
                                edgecolor="white", linewidth=1.2, zorder=3)
        self._axes(ax)
        width, height = cell_shape(area_px, cols, len(rows))
        if width * len(rows) * height * cols < 0.99 * area_px[0] * area_px[1]:  # stretched to the limit
            ax.set_aspect(height / width)  # the rest of the area stays empty; otherwise the cells fill the axes

    def _square(self, block: int, inset: float) -> list[tuple[float, float]]:
        """The corners of a block's cell, `inset` (in cells) inside its edges."""
        x, y = self.where[block]
        lo, hi = -0.5 + inset, 0.5 - inset
        return [(x + lo, y + lo), (x + hi, y + lo), (x + hi, y + hi), (x + lo, y + hi)]

    def ring(self, blocks: Iterable[int], color: str) -> None:
        """Lesson mode's lasting double ring, `color` outside and white inside, as the page draws it (block_pool.js),
        around each of `blocks` the grid shows."""
        shown = [b for b in blocks if b in self.where]
        width_px = max(RING_MIN_PX, self.cell_px / 24)
        to_pt, to_cells = 72 / self.ax.figure.dpi, 1 / max(self.cell_px, 1)
        for edge, inset, px in ((color, width_px / 2, width_px), ("white", width_px * 1.1, width_px / 3)):
            squares = [self._square(b, self.gap + inset * to_cells) for b in shown]
            self.ax.add_collection(PolyCollection(squares, facecolors="none", edgecolors=edge,
                                                  linewidths=px * to_pt, zorder=5))

    @property
    def artists(self) -> list:
        """What changes from one moment to the next."""
        return [self.cells, self.marks, *self.labels]

    def show(self, cells: PoolCells) -> None:
        self.cells.set_facecolors([cells.colors[b] for b in self.blocks])
        for label in self.labels:
            label.set_color(_ink(cells.colors[int(label.get_text())]))
        points = [self.where[b] for b in cells.shared if b in self.where]
        self.marks.set_offsets(np.array(points, dtype=float).reshape(-1, 2))

    def _axes(self, ax: Axes) -> None:
        cols, rows = self.layout.cols, self.layout.rows
        ax.set_xlim(-0.5, cols - 0.5)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        step_x, step_y = max(1, cols // 16), max(1, len(rows) // 12)
        ax.set_xticks(range(0, cols, step_x), [str(c) for c in range(0, cols, step_x)])
        ax.set_yticks(range(0, len(rows), step_y), [str(rows[i] * cols) for i in range(0, len(rows), step_y)])
        ax.tick_params(length=0)
        ax.set_xlabel("block id − row start (column)")
        ax.set_ylabel("row start block id")
        for i in range(1, len(rows)):
            if rows[i] != rows[i - 1] + 1:  # rows nobody used are left out here
                ax.axhline(i - 0.5, color="#6b7280", linestyle=(0, (4, 3)), linewidth=2, zorder=4)
        for spine in ax.spines.values():
            spine.set_visible(False)


def shown_rows_note(layout: PoolLayout) -> str:
    """What the crop left out, for the subtitle."""
    shown = sum(min(layout.cols, layout.num_blocks - r * layout.cols) for r in layout.rows)
    if shown == layout.num_blocks:
        return f"{layout.num_blocks} blocks"
    return f"{shown} of {layout.num_blocks} blocks shown (rows never used left out)"


def pool_legend(ax: Axes, colors: dict[str, str], order: list[str], cells: PoolCells | None,
                max_rows: int = 20) -> None:
    """Block states, then the requests (with their blocks in use when `cells` is the one moment shown),
    in as many columns as `max_rows` lines need."""
    in_use = [r for r in order if r in cells.per_request] if cells else order
    free = f" ({cells.free})" if cells else ""
    cached = f" ({cells.cached})" if cells else ""
    handles = [Patch(facecolor=BLOCK_COLORS["free"], edgecolor="#bbbbbb", label=f"free{free}"),
               Patch(color=BLOCK_COLORS["cached"], label=f"cached, evictable{cached}"),
               Line2D([], [], marker="o", color=BLOCK_COLORS["shared"], markeredgecolor="white", ls="",
                      markersize=SHARED_MARK_PX * 0.72, label="shared (ref count > 1)")]
    counts = {r: f" ({cells.per_request[r]} in use)" for r in in_use} if cells else {}
    handles += request_handles(colors, in_use, counts)
    legend_outside(ax, handles, title="blocks", ncols=-(-len(handles) // max_rows))


def pool_facts(cells: PoolCells) -> str:
    return (f"{cells.in_use} of {len(cells.colors)} blocks in use · {cells.cached} cached · {cells.free} free · "
            f"{len(cells.shared)} shared")


Ring = tuple[Sequence[int], str]  # the blocks a lesson moment concerns, and the colour of its ring


def strip_titles(state: RunState) -> list[str]:
    """One title per block-pool strip: a strip per tensor-parallel rank, as on the page; one untitled strip."""
    if not state.ranks:
        return [""]
    from kvscope.frontend.views.block_pool import on_hosts, rank_title  # the page's words; NiceGUI loads for TP only

    replicated = bool((state.tensor_parallel or {}).get("kv_heads_replicated"))
    return [rank_title(rank, state.cache.get("block_size", 0), replicated, on_hosts(state)) for rank in state.ranks]


def pool_area(size: Size, strips: int = 1) -> tuple[float, float]:
    """The room (px) a strip's grid gets on a slide, beside the legend and under the titles."""
    return 0.72 * size[0], 0.72 * size[1] / strips


def draw_blocks(run: ExportedRun, seconds: bool = False, size: Size = SLIDE_SIZE, ring: Ring | None = None) -> Figure:
    """The pool at the run's last replayed step (a strip per rank), its blocks in `ring` ringed; the title
    says when that step is the run's peak (the default the still picture is drawn at)."""
    state, titles = run.state, strip_titles(run.state)
    area = pool_area(size, len(titles))
    layout = pool_layout(state.num_blocks, used_blocks(run.events), area)
    colors = request_colors(run)
    cells = pool_cells(state, colors, run.order)
    subtitle = (f"{pool_facts(cells)} · {shown_rows_note(layout)} × {state.cache.get('block_size', '?')} tokens"
                + (" · end of trace" if state.finished else ""))
    fig, axes = frame(run, "KV block pool", subtitle, size, rows=len(titles),
                      step_note="the peak" if run.last == run.peak else "")
    for ax, strip in zip(axes, titles):
        grid = PoolGrid(ax, layout, area)
        grid.show(cells)
        if ring is not None:
            grid.ring(*ring)
        if strip:
            ax.set_title(f"{ax.get_title(loc='left')}\n{strip}".lstrip(), fontsize=SUBTITLE_PT, loc="left",
                         color="#444444")
    for ax in axes[:-1]:
        ax.set_xlabel("")  # one column label under the last strip
    pool_legend(axes[0], colors, run.order, cells)
    return fig
