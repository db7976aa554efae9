"""ECharts elements of the live views. They are updated only through `FeedView.push`, which calls
the chart's own `setOption` with the parts that changed: `element.update()` would resend the whole
option, every series' data included (PITFALLS: web stack)."""

from __future__ import annotations

from typing import Any

from nicegui import ui


BASE_OPTIONS: dict[str, Any] = {
    "animation": False,  # live data: tweening every update would lag behind and cost CPU
    "textStyle": {"fontFamily": "Inter, Roboto, sans-serif"},
}


def make_chart(options: dict[str, Any], height: str, marker: str) -> ui.echart:
    chart = ui.echart({**BASE_OPTIONS, **options}).style(f"width:100%;height:{height}").mark(marker) \
        .props(f"data-kv={marker}")  # for the browser test
    return chart
