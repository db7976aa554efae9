"""Side by side in a real browser (headless Chromium): the block pools drawn to one byte scale.

Fixtures from tests/test_browser.py: its `page` fails a test on any page error or console error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server_helpers import wait_for
from tests.test_browser import (CHROMIUM, api, backend_url, browser, dashboard_url, page, scenario,  # noqa: F401
                                start, wait_at_rest)

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is not installed")
import os

# KVSCOPE_COMPARE_SHOTS=FOLDER: write the screenshots there to look at (never into the tree by default)
SHOTS = Path(os.environ.get("KVSCOPE_COMPARE_SHOTS", "/nonexistent"))

# What each pool's canvas paints: its pixels' coverage (alpha; a cell's antialiased edge counts in part),
# every block painted (free ones grey)
PAINTED = """(el) => {
    const data = el.getContext('2d').getImageData(0, 0, el.width, el.height).data;
    let n = 0;
    for (let i = 3; i < data.length; i += 4) n += data[i] / 255;
    return {painted: n, blocks: +el.dataset.blocks, cell: +el.dataset.cell, bytes: +el.dataset.bytesPerBlock};
}"""


def pools(page) -> list[dict]:
    return [page.locator("[data-kv=block-pool] canvas").nth(i).evaluate(PAINTED) for i in range(2)]


@pytest.mark.parametrize("viewport", [(1600, 1000), (1280, 720)])
def test_mha_and_gqa_pools_are_drawn_to_one_byte_scale(page, backend_url, dashboard_url, viewport):
    """MHA vs GQA looked identical (#22): same blocks, so the same grid. Drawn to one scale, the MHA pool
    (4x the KV heads, 4x the bytes per block) covers 4x the area, within a few percent."""
    page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
    ids = [start(backend_url, scenario(model, f"pool-{model}", 64, 4, 4, (16, 32), (8, 16), {"process": "burst"}),
                 speed=1, paused=True) for model in ("demo-mha", "demo")]
    page.goto(f"{dashboard_url}/?run={ids[0]}&compare={ids[1]}")
    page.wait_for_function("""() => { const c = document.querySelectorAll('[data-kv=block-pool] canvas');
        return c.length === 2 && [...c].every((el) => +el.dataset.blocks === 64 && +el.dataset.bytesPerBlock > 0); }""")
    wait_at_rest(page, "both pools painted")  # the frame after the last layout
    mha, gqa = pools(page)
    bytes_ratio = (mha["blocks"] * mha["bytes"]) / (gqa["blocks"] * gqa["bytes"])
    assert bytes_ratio == 4
    assert mha["painted"] / gqa["painted"] == pytest.approx(bytes_ratio, rel=0.04)
    assert mha["cell"] / gqa["cell"] == pytest.approx(2, rel=1e-6)
    captions = page.locator("[data-kv=block-pool]").evaluate_all(
        "(els) => els.map((el) => el.closest('.kv-card').querySelector('.kv-caption').innerText)")
    assert all("drawn to scale with the other pool (equal area, equal bytes)" in c for c in captions)
    if SHOTS.is_dir():
        page.screenshot(path=str(SHOTS / f"mha-gqa-{viewport[0]}.png"), full_page=False)


def test_a_block_size_compared_at_the_same_memory_is_drawn_the_same_area(page, backend_url, dashboard_url):
    """Block size 16 vs 1 at the same bytes (the compare form's default): 64 blocks vs 1024, one area."""
    big, small = (scenario("demo", f"size-{size}", blocks, 4, 4, (16, 32), (8, 16), {"process": "burst"})
                  for size, blocks in ((16, 64), (1, 1024)))
    small["engine"]["block_size"] = 1
    ids = [start(backend_url, s, speed=1, paused=True) for s in (big, small)]
    page.goto(f"{dashboard_url}/?run={ids[0]}&compare={ids[1]}")
    page.wait_for_function("""() => { const c = document.querySelectorAll('[data-kv=block-pool] canvas');
        return c.length === 2 && [...c].every((el) => +el.dataset.bytesPerBlock > 0); }""")
    wait_at_rest(page, "both pools painted")
    a, b = pools(page)
    assert a["blocks"] * a["bytes"] == b["blocks"] * b["bytes"]
    assert a["painted"] / b["painted"] == pytest.approx(1, rel=0.04)
    if SHOTS.is_dir():
        page.screenshot(path=str(SHOTS / "block-16-vs-1.png"), full_page=False)


def test_a_lesson_side_by_side_has_both_cards_and_holds_the_other_run(page, backend_url, dashboard_url, tiny_dir):
    """memory-pressure in lesson mode, 24 blocks vs 256: two lesson cards; one continue starts both; the
    preemption on the left holds the right, and the page says so (no page error: the fixture fails on any)."""
    ids = [api(backend_url, "/api/runs", {"scenario": "memory-pressure", "speed": 4, "paused": True, "lesson": True,
                                          "overrides": {"model": tiny_dir, "engine.num_blocks": blocks}})["run_id"]
           for blocks in (24, 256)]
    page.goto(f"{dashboard_url}/?run={ids[0]}&compare={ids[1]}")
    cards = page.locator(".kv-lesson-card")
    cards.nth(1).wait_for()
    assert cards.count() == 2
    page.locator("[data-kv=lesson-continue]").first.click()
    page.get_by_text("reached “First preemption”").wait_for()
    state = [api(backend_url, f"/api/runs/{run_id}") for run_id in ids]
    assert state[0]["num_preemptions"] >= 1 and all(s["paused"] and not s["finished"] for s in state)
    for viewport in ((1600, 1000), (1280, 720)):
        page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
        wait_at_rest(page, f"laid out at {viewport[0]}x{viewport[1]}")
        if SHOTS.is_dir():
            page.screenshot(path=str(SHOTS / f"lesson-compare-{viewport[0]}.png"), full_page=False)
    page.locator("[data-kv=lesson-continue]").first.click()
    wait_for(lambda: not api(backend_url, f"/api/runs/{ids[1]}")["paused"] or
             api(backend_url, f"/api/runs/{ids[1]}")["finished"], "continue did not resume the held run")


def test_gguf_weights_compared_state_each_runs_weights_and_median_decode_step(page, backend_url, dashboard_url):
    """quantized-weights, float32 against as stored, as the compare drawer's "GGUF weights" starts them:
    the row of differences says 513.1 MiB against 90.5 MiB and a median decode step for each side."""
    from kvscope.backend.model.loader import missing_package
    from kvscope.frontend.compare import AXES, override_of

    if missing_package("smollm2"):
        pytest.skip(missing_package("smollm2"))
    ids = [api(backend_url, "/api/runs", {"scenario": "quantized-weights", "speed": 0, "paused": False,
                                          "overrides": override_of(AXES["weight_storage"], value)})["run_id"]
           for value in ("float32", "native")]
    page.goto(f"{dashboard_url}/?run={ids[0]}&compare={ids[1]}")
    table = page.locator(".kv-side-table")

    wait_for(lambda: table.count() and "90.5 MiB" in table.inner_text() and "513.1 MiB" in table.inner_text()
             and table.inner_text().count(" ms") >= 6, "no weights or decode steps in the row")

    def decode_steps() -> list[str] | None:
        """The two runs' median decode steps, read from one rendering of the row (it is redrawn as the runs go
        on, and a figure that stops being the same in both adds a column)."""
        rows = table.first.evaluate("(t) => [...t.querySelectorAll('tr')]"
                                    ".map((tr) => [...tr.cells].map((c) => c.innerText))")
        head = "median decode step (measured on this CPU)"
        if len(rows) < 3 or head not in rows[0]:
            return None
        cells = [row[rows[0].index(head)] for row in rows[1:3] if len(row) == len(rows[0])]
        return cells if len(cells) == 2 and all(c.endswith(" ms") for c in cells) else None

    cells = wait_for(decode_steps, "no median decode step for each run")
    assert all(float(c.split()[0]) > 0 for c in cells), cells
    titles = page.locator(".kv-side-run").all_inner_texts()
    assert "GGUF weights: float32" in titles[0] and "GGUF weights: as stored (Q4: int4)" in titles[1]
    # Each roofline also draws the other run's points, hollow: both runs against one pair of roofs.
    def rooflines() -> list[list[int]]:  # per chart: [the other run's points, its own]
        return page.evaluate("""() => Array.from(document.querySelectorAll('[data-kv=roofline]')).map((el) => {
            const series = getElement(el.id.slice(1)).chart.getOption().series;
            const other = series.find((s) => s.id === 'other-run');
            return [other ? other.data.length : -1, series.filter((s) => s.type === 'scatter' && s.id !== 'other-run')
                .reduce((n, s) => n + s.data.length, 0)];
        })""")

    wait_for(lambda: (r := rooflines()) and len(r) == 2 and r[0][0] == r[1][1] > 40 and r[1][0] == r[0][1] > 40,
             "the rooflines do not each draw the other run's points")
    captions = page.locator("[data-kv=roofline]").evaluate_all(
        "(els) => els.map((el) => el.closest('.kv-card').querySelector('.kv-caption').innerText)")
    assert "hollow ◇: GGUF weights: as stored (Q4: int4)" in captions[0] and "GGUF weights: float32" in captions[1]
    if SHOTS.is_dir():
        table.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "gguf-weights.png"), full_page=False)
        page.locator("[data-kv=roofline]").first.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "gguf-roofline.png"), full_page=False)
