"""Tensor parallelism in a real browser (headless Chromium): a strip per rank in the block pool, the all-reduce
band in the timeline, live and replayed, and the side-by-side row that states bytes per rank.

The `tensor-parallel` scenario runs for real (two ranks, two processes) in the test's backend. Fixtures from
tests/test_browser.py: its `page` fails a test on any page error or console error.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from tests.server_helpers import wait_for
from tests.test_browser import (CHROMIUM, COMPONENT, api, backend_url, browser, dashboard_url, page)  # noqa: F401

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is not installed")

# KVSCOPE_TP_SHOTS=FOLDER: write the screenshots there to look at (never into the tree by default)
SHOTS = Path(os.environ.get("KVSCOPE_TP_SHOTS", "/nonexistent"))
RANKS = ("block-pool", "block-pool-rank-1")  # the two strips' canvases, rank 0's first
# What the page drew: each strip's cells and bytes per block, the timeline's band and first row
DRAWN = f"""() => {{
    const c = {COMPONENT};
    const strip = (kv) => {{ const s = c(kv); return s && s.cells ? {{state: Array.from(s.cells.state),
        bytes: s.bytesPerBlock, ringed: s.$refs.canvas.dataset.ringed || ''}} : null; }};
    const option = c('timeline').chart.getOption();
    const band = option.series.filter((s) => s && String(s.id).startsWith('ar-')).flatMap((s) => s.data);
    return {{strips: {json.dumps(RANKS)}.map(strip), band, rows: option.yAxis[0].data}};
}}"""


@pytest.fixture(scope="module")
def tp_trace(backend_url) -> tuple[str, str]:  # noqa: F811
    """The tensor-parallel scenario run once, unpaced, to its end: its id and trace."""
    run_id = api(backend_url, "/api/runs", {"scenario": "tensor-parallel", "speed": 0, "paused": False})["run_id"]
    wait_for(lambda: api(backend_url, f"/api/runs/{run_id}")["finished"], "the run did not finish")
    with urllib.request.urlopen(f"{backend_url}/api/runs/{run_id}/trace", timeout=30) as r:
        return run_id, r.read().decode()


def drawn(page, steps: int) -> dict:
    """The page's drawing once both strips and a band item per step are there."""
    wait_for(lambda: (d := page.evaluate(DRAWN)) and all(d["strips"]) and len(d["band"]) == steps,
             f"no two strips and {steps} all-reduce steps: {page.evaluate(DRAWN)}")
    return page.evaluate(DRAWN)


def test_a_tensor_parallel_run_has_a_strip_per_rank_and_an_all_reduce_band(  # noqa: F811
        page, backend_url, dashboard_url, tp_trace):
    """Two strips, titled with their heads and bytes, painting the same blocks at half a block's bytes; the
    timeline's first row is the all-reduce band, one item per step, its share that of the recorded step."""
    run_id, trace = tp_trace
    steps = api(backend_url, f"/api/runs/{run_id}")["step"] + 1
    page.goto(f"{dashboard_url}/?run={run_id}")
    d = drawn(page, steps)
    rank0, rank1 = d["strips"]
    assert rank0["state"] == rank1["state"] and any(rank0["state"])  # one block table: the same blocks
    assert rank0["bytes"] == rank1["bytes"] == 16 * 1536  # a block of 16 tokens, one KV head of two
    titles = page.locator("[data-kv=block-pool-rank]").all_inner_texts()
    assert titles == ["rank 0 · query heads 0–3 · KV head 0 · 24.0 KiB per block, 1.5 MiB in all",
                      "rank 1 · query heads 4–7 · KV head 1 · 24.0 KiB per block, 1.5 MiB in all"]
    assert d["rows"][0] == "all-reduce"
    for x0, x1, row, share, ms, step, count, _, step_ms in d["band"]:
        assert (x0, x1, row, count) == (step - 0.5, step + 0.5, 0, 12)
        assert share == pytest.approx(ms / step_ms, abs=1e-3)
    timeline = page.locator(".kv-card", has=page.locator("[data-kv=timeline]"))
    assert "all-reduce: rank 0's share of the step" in timeline.inner_text()  # the legend names the band
    if SHOTS.is_dir():
        page.evaluate("document.querySelector('[data-kv=block-pool]').closest('.kv-card').scrollIntoView()")
        page.screenshot(path=str(SHOTS / "tp-live.png"), full_page=False)


def test_a_replayed_tensor_parallel_trace_draws_the_band_on_either_clock(  # noqa: F811
        page, backend_url, dashboard_url, tp_trace):
    """Replayed, the band is the live run's; on the seconds axis each step's item spans its recorded duration; the
    modelled axis has none."""
    _, trace = tp_trace
    steps = sum('"type": "iteration"' in line or '"type":"iteration"' in line for line in trace.splitlines())
    replay = api(backend_url, "/api/runs", {"trace": trace, "speed": 0, "paused": False})["run_id"]
    page.goto(f"{dashboard_url}/?run={replay}")
    assert len(drawn(page, steps)["band"]) == steps
    timeline = page.locator(".kv-card", has=page.locator("[data-kv=timeline]"))
    timeline.get_by_text("seconds", exact=True).click()

    def in_seconds() -> bool:  # each step's item as long as the step took
        band = page.evaluate(DRAWN)["band"]
        return len(band) == steps and all(abs(x1 - x0 - step_ms / 1000) < 1e-3 for x0, x1, *_, step_ms in band)

    wait_for(in_seconds, "the band did not move to seconds")
    if SHOTS.is_dir():
        page.locator("[data-kv=timeline]").scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "tp-replay-seconds.png"), full_page=False)
    timeline.locator(".q-btn", has_text="modelled on").click()  # modelled time has no measured all-reduce in it
    wait_for(lambda: not page.evaluate(DRAWN)["band"] and page.evaluate(DRAWN)["rows"][0] != "all-reduce",
             "the band stayed on the modelled axis")


def test_one_rank_against_two_side_by_side_states_bytes_per_rank_and_all_reduces(  # noqa: F811
        page, backend_url, dashboard_url):
    """The compare drawer's "tensor-parallel ranks", 1 against 2: titles, the row's per-rank figures, and two
    half-byte strips drawn to the one pool's scale (together the same area)."""
    from kvscope.frontend.compare import AXES, override_of

    ids = [api(backend_url, "/api/runs", {"scenario": "tensor-parallel", "speed": 0, "paused": False,
                                          "overrides": override_of(AXES["tensor_parallel"], ranks)})["run_id"]
           for ranks in (1, 2)]
    page.goto(f"{dashboard_url}/?run={ids[0]}&compare={ids[1]}")
    table = page.locator(".kv-side-table")
    wait_for(lambda: table.count() and "10.6 MiB" in table.inner_text(), "no weights per rank in the row")

    def one_rendering() -> list[list[str]] | None:
        """The row's header and both runs' cells read at once: it is redrawn as the runs go on, and a figure
        that stops being the same in both adds a column (read apart, a header and its cells could differ)."""
        rows = table.first.evaluate("(t) => [...t.querySelectorAll('tr')]"
                                    ".map((tr) => [...tr.cells].map((c) => c.innerText))")
        whole = len(rows) >= 3 and len(rows[1]) == len(rows[2]) == len(rows[0]) and "weights per rank" in rows[0]
        return rows[:3] if whole and rows[2][rows[0].index("weights per rank")] == "10.6 MiB" else None

    heads, *cells = wait_for(one_rendering, "no whole rendering of the row")
    rows = {head: (a, b) for head, a, b in zip(heads, *cells)}
    assert rows["weights per rank"] == ("19.3 MiB", "10.6 MiB")
    assert rows["KV bytes per token per rank"] == ("3,072", "1,536")
    assert rows["all-reduces per step"] == ("0", "12")
    assert cells[0][0].startswith("tensor-parallel ranks: 1") and cells[1][0].startswith("tensor-parallel ranks: 2")
    painted = page.evaluate("""() => [...document.querySelectorAll('[data-kv^=block-pool] canvas')].map((el) => {
        const data = el.getContext('2d').getImageData(0, 0, el.width, el.height).data;
        let n = 0;
        for (let i = 3; i < data.length; i += 4) n += data[i] / 255;
        return n; })""")
    assert len(painted) == 3 and painted[1] + painted[2] == pytest.approx(painted[0], rel=0.06)
    if SHOTS.is_dir():
        table.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "tp-compare.png"), full_page=False)
