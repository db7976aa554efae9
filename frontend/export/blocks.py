"""The block pool picture: every KV block as a cell, coloured by the request owning it."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from kvscope.frontend.export.figure import frame, legend_outside, request_colors, request_handles
from kvscope.frontend.export.replayed import ExportedRun
from kvscope.frontend.palette import BLOCK_COLORS


def grid_columns(num_blocks: int) -> int:
    for cols, limit in ((8, 32), (16, 256), (32, 1024), (64, 8192)):
        if num_blocks <= limit:
            return cols
    return 64 * math.ceil(math.sqrt(2 * num_blocks) / 64)


def block_owners(run: ExportedRun) -> dict[int, str]:
    """In-use block -> the earliest-arrived request among its owners."""
    rank = {rid: i for i, rid in enumerate(run.order)}
    owners = {}
    for block, seqs in run.state.block_owner.items():
        rids = [run.state.seq_request[s] for s in seqs if s in run.state.seq_request]
        if rids:
            owners[block] = min(rids, key=lambda r: rank.get(r, len(rank)))
    return owners


def draw_blocks(run: ExportedRun, seconds: bool = False) -> Figure:
    state, n = run.state, run.state.num_blocks
    cols = grid_columns(n)
    rows = math.ceil(n / cols)
    colors, owners = request_colors(run), block_owners(run)
    free, cached = set(state.free_blocks) - state.cached_blocks, state.cached_blocks
    shared = sorted(b for b, count in state.ref_counts.items() if count > 1)
    subtitle = (f"at step {run.last}{' (end of trace)' if state.finished else ''} · {n} blocks × "
                f"{state.cache.get('block_size', '?')} tokens · {n - len(free) - len(cached)} in use · "
                f"{len(cached)} cached · {len(free)} free · {len(shared)} shared")
    fig, (ax,) = frame(run, "KV block pool", subtitle, (13, min(14, max(4.5, 1.8 + rows * 9 / cols))))
    cell_colors = {**{b: colors.get(r, "black") for b, r in owners.items()},
                   **dict.fromkeys(free, BLOCK_COLORS["free"]),
                   **dict.fromkeys(cached, BLOCK_COLORS["cached"])}
    image = [[to_rgb("white")] * cols for _ in range(rows)]  # [rows, cols, rgb]; the tail of the last row stays white
    for block in range(n):
        image[block // cols][block % cols] = to_rgb(cell_colors.get(block, "black"))
    ax.imshow(image, interpolation="nearest", aspect="equal")
    _block_marks(ax, image, n, shared)
    _block_axes(ax, cols, rows)
    _block_legend(ax, colors, owners, run.order, len(free), len(cached))
    return fig


def _block_legend(ax: Axes, colors: dict[str, Any], owners: dict[int, str], order: list[str], free: int,
                  cached: int) -> None:
    per_request = Counter(owners.values())
    in_use = [r for r in order if r in per_request]
    handles = [Patch(facecolor=BLOCK_COLORS["free"], edgecolor="#bbbbbb", label=f"free ({free})"),
               Patch(color=BLOCK_COLORS["cached"], label=f"cached, evictable ({cached})"),
               Line2D([], [], marker="o", color=BLOCK_COLORS["shared"], markeredgecolor="white", ls="",
                      label="shared (ref count > 1)")]
    counts = {r: f" ({per_request[r]} in use)" for r in in_use}
    legend_outside(ax, handles + request_handles(colors, in_use, counts), title="blocks")


def _block_marks(ax: Axes, image: list[list[tuple]], num_blocks: int, shared: list[int]) -> None:
    """A dot on shared blocks; block ids written in the cells while there are few."""
    cols = len(image[0])
    size = max(4, 260 / cols)
    if shared:
        ax.scatter([b % cols for b in shared], [b // cols for b in shared], s=size, color=BLOCK_COLORS["shared"],
                   edgecolor="white", linewidth=0.6, zorder=3)
    if num_blocks <= 128:
        for block in range(num_blocks):
            r, g, b = image[block // cols][block % cols]
            ink = "#222222" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"
            ax.text(block % cols, block // cols + 0.3, str(block), ha="center", va="center", fontsize=7, color=ink)


def _block_axes(ax: Axes, cols: int, rows: int) -> None:
    ax.set_xticks([c - 0.5 for c in range(cols + 1)], minor=True)
    ax.set_yticks([r - 0.5 for r in range(rows + 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5 if cols <= 16 else 0.5)
    ax.tick_params(which="minor", length=0)
    step_x, step_y = max(1, cols // 16), max(1, rows // 16)
    ax.set_xticks(range(0, cols, step_x), [str(c) for c in range(0, cols, step_x)])
    ax.set_yticks(range(0, rows, step_y), [str(r * cols) for r in range(0, rows, step_y)])
    ax.set_xlabel("block id − row start (column)")
    ax.set_ylabel("row start block id")
    for spine in ax.spines.values():
        spine.set_visible(False)
