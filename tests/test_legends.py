"""Every view whose marks carry meaning by colour has a legend that names each of those colours.

Each entry pairs a view's legend (what the page shows under its title) with the palette colours its
marks are drawn in (frontend/palette.py): a colour added to a view without a legend entry fails here.
"""

from __future__ import annotations

import pytest

from kvscope.frontend.palette import (ALLREDUCE_COLOR, BLOCK_COLORS, BUDGET_COLOR, CHIP_COLORS, FLASH_COLORS,
                                      FOCUS_COLOR, MANY_REQUESTS_COLOR, MASK_COLORS, PHASE_COLORS, SLOT_COLORS,
                                      SPEC_COLORS, TOKEN_MARK_COLORS, TRANSFER_COLOR, request_color)
from kvscope.frontend.sampling_math import STAGE_LABELS
from kvscope.frontend.views import attention, batch, block_pool, block_table, metrics, sampling, speculative, timeline

# view -> (its legend as (swatch css, label) pairs, the colours its marks are drawn in)
VIEWS = {
    "timeline": (timeline.legend_items(), [c for kind, c in PHASE_COLORS.items() if kind != "recompute"] + ["#111"]),
    "timeline without a KV cache": (timeline.legend_items(kv_cache=False),
                                    [c for kind, c in PHASE_COLORS.items() if kind != "decode"] + ["#111"]),
    "timeline of a tensor-parallel run": (timeline.legend_items(allreduce=True),
                                          [c for kind, c in PHASE_COLORS.items() if kind != "recompute"]
                                          + ["#111", ALLREDUCE_COLOR]),
    "batch": (batch.legend_items(), [request_color(0), MANY_REQUESTS_COLOR, BUDGET_COLOR, SLOT_COLORS["used"],
                             SLOT_COLORS["idle"]]),
    "block pool": (block_pool.LEGEND + block_pool.ring_legend(),
                   [*BLOCK_COLORS.values(), request_color(0), *(c for k, c in FLASH_COLORS.items() if k != "move"),
                    FOCUS_COLOR]),
    "block pool of a disaggregated run": (block_pool.LEGEND + block_pool.ring_legend(moves=True),
                                          [*BLOCK_COLORS.values(), request_color(0), *FLASH_COLORS.values(),
                                           FOCUS_COLOR]),
    "timeline of a disaggregated run": (timeline.legend_items(moves=True),
                                        [c for kind, c in PHASE_COLORS.items() if kind != "recompute"]
                                        + ["#111", TRANSFER_COLOR]),
    "block table": (block_table.LEGEND, [request_color(0), *CHIP_COLORS.values()]),
    "attention": (attention.LEGEND, [*MASK_COLORS.values()]),
    "sampling": (sampling.LEGEND + sampling.MASK_LEGEND
                 + [(sampling.STAGE_COLORS[s], STAGE_LABELS[s]) for s in sampling.STAGE_COLORS],
                 [*TOKEN_MARK_COLORS.values(), *sampling.STAGE_COLORS.values()]),
    "speculative": (speculative.LEGEND + [(speculative.P_COLOR, "p (target)"), (speculative.Q_COLOR, "q (draft)")],
                    [*SPEC_COLORS.values(), speculative.P_COLOR, speculative.Q_COLOR]),
    "metrics": ([(color, name) for _, name, color, _ in metrics.LINES],
                [color for *_, color, _ in metrics.LINES]),
}
# Views without colour that means something: the KV calculator (numbers and formulas only).


@pytest.mark.parametrize("view", VIEWS)
def test_every_colour_a_view_draws_with_is_named_in_its_legend(view: str) -> None:
    items, colors = VIEWS[view]
    for color in colors:
        named = [label for swatch, label in items if color.lower() in swatch.lower()]
        assert named and all(label.strip() for label in named), f"{view}: {color} has no legend entry"

