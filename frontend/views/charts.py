"""ECharts elements of the live views. They are updated only through `FeedView.push`, which calls
the chart's own `setOption` with the parts that changed: `element.update()` would resend the whole
option, every series' data included (PITFALLS: web stack)."""

from __future__ import annotations

from typing import Any

from nicegui import ui


# kvscope-em (static/kvscope.css) gives "国", which zrender measures as a line's height, its true size
CHART_FONT = "Inter, Roboto, kvscope-em, sans-serif"
BASE_OPTIONS: dict[str, Any] = {
    "animation": False,  # live data: tweening every update would lag behind and cost CPU
    "textStyle": {"fontFamily": CHART_FONT},
}


def make_chart(options: dict[str, Any], height: str, marker: str) -> ui.echart:
    chart = ui.echart({**BASE_OPTIONS, **options}).style(f"width:100%;height:{height}").mark(marker) \
        .props(f"data-kv={marker}")  # for the browser test
    return chart


def probability_bars(grid_top: int = 30, grid_bottom: int = 62) -> dict[str, Any]:
    """Options of a bar chart of token probabilities (tokens on x, series filled in by the view)."""
    return {
        # one scrolling row of legend, the y axis named along its side: at 16 px (projector mode) a
        # wrapped legend ran into a name above the axis
        "legend": {"top": 0, "type": "scroll", "textStyle": {"fontSize": 11}, "pageTextStyle": {"fontSize": 16}},
        "tooltip": {"trigger": "axis", "axisPointer": {"type": "shadow"}},
        "grid": {"left": 72, "right": 12, "top": grid_top, "bottom": grid_bottom},
        "xAxis": {"type": "category", "data": [], "axisLabel": {"interval": 0, "rotate": 40, "fontSize": 11}},
        "yAxis": {"type": "value", "name": "probability", "nameLocation": "middle", "nameGap": 50, "max": 1},
        "series": [],
    }
