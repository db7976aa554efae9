"""Projector mode in a room (#22): in headless Chromium at 1280x720 and 1920x1080, no text is under 16 px,
no two labels overlap (measured on the boxes ECharts itself draws and on the page's own elements), and the
marks a lesson points at (beam forks, prunes, finishes; the block pool's rings) are at least 16 px. That a
lesson pause shows its card and the views it names on one screen is the lesson walk's (test_lesson_walk).

Shares test_browser's servers and its `page` fixture, which fails a test on any page error.
`KVSCOPE_SHOTS=folder` saves a screenshot of every layout checked here, to look at.
"""

from __future__ import annotations

import pytest

from kvscope.frontend.palette import SLOT_COLORS, ring_color
from tests.server_helpers import wait_for
from tests.test_browser import (COMPONENT, MEASURE, PROJECTOR_PX, SHOTS, api, backend_url, browser,  # noqa: F401
                                dashboard_url, laid_out, measure_when, page, pytestmark, wait_at_rest)

SIZES = ((1280, 720), (1920, 1080))

# Every text ECharts drew, as boxes on the page: zrender's own text elements (axis labels and names,
# legend items, titles) and the labels of shapes, with the transforms that placed them.
CHART_TEXTS = """() => {
    const out = {};
    for (const el of document.querySelectorAll('[data-kv]')) {
        const c = window.getElement && getElement(el.id.slice(1));
        if (!c || !c.chart || c.chart.isDisposed()) continue;
        const texts = [];
        const visit = (e, clip) => {  // clip: the box a scrolling legend shows its current page in
            if (e.ignore || e.invisible) return;
            const path = e.getClipPath && e.getClipPath();
            if (path) {
                const r = path.getBoundingRect().clone();
                r.applyTransform(path.getComputedTransform() || e.getComputedTransform());
                clip = [r.x, r.y, r.x + r.width, r.y + r.height];
            }
            const label = e.getTextContent && e.getTextContent();
            if (label) visit(label, clip);
            const text = e.type === 'text' && e.style && e.style.text;
            if (text !== undefined && text !== false && String(text).trim() && (e.style.opacity ?? 1) > 0) {
                const r = e.getBoundingRect(), m = e.getComputedTransform() || [1, 0, 0, 1, 0, 0];
                const corners = [[r.x, r.y], [r.x + r.width, r.y], [r.x + r.width, r.y + r.height], [r.x, r.y + r.height]]
                    .map(([x, y]) => [m[0] * x + m[2] * y + m[4], m[1] * x + m[3] * y + m[5]]);  // rotated labels too
                const cx = corners.reduce((a, c) => a + c[0], 0) / 4, cy = corners.reduce((a, c) => a + c[1], 0) / 4;
                if (clip && (cx < clip[0] || cx > clip[2] || cy < clip[1] || cy > clip[3])) return;  // on another page
                const px = e.style.fontSize || parseFloat((/([\\d.]+)px/.exec(e.style.font || '') || [])[1]) || 12;
                texts.push({text: String(text).slice(0, 24), corners, px});
            }
            if (e.isGroup) for (const k of e.children()) visit(k, clip);
        };
        for (const root of c.chart.getZr().storage.getRoots()) visit(root, null);
        const o = c.chart.getOption();
        const sizes = (list) => (list || []).map((x) => (x.textStyle || {}).fontSize || 12);
        out[el.dataset.kv] = {texts, option: [...sizes(o.legend), ...sizes(o.tooltip), ...sizes(o.dataZoom)]};
    }
    return out;
}"""

# The page's own labels that overlap another (neither inside the other), in the views and the dock.
DOM_OVERLAPS = """() => {
    const own = (el) => Array.from(el.childNodes).some((n) => n.nodeType === 3 && n.textContent.trim());
    const els = Array.from(document.querySelectorAll('.kv-main *')).filter((el) => own(el) && el.getClientRects().length
        && getComputedStyle(el).visibility !== 'hidden' && !el.closest('.q-field, .q-btn, .q-toggle, .q-slider, .nicegui-echart'));
    const boxes = els.map((el) => Array.from(el.getClientRects()));  // an inline element wrapped: one per line
    const meet = (a, b) => a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
    const out = [];
    for (let i = 0; i < els.length; i++) for (let j = i + 1; j < els.length; j++) {
        if (els[i].contains(els[j]) || els[j].contains(els[i])) continue;
        if (boxes[i].some((a) => boxes[j].some((b) => meet(a, b))))
            out.push(`${els[i].textContent.trim().slice(0, 20)} / ${els[j].textContent.trim().slice(0, 20)}`);
    }
    return out;
}"""

# The beam marks' boxes ([x0, y0, x1, y1] by mark) and the timeline's plot, in the chart's pixels.
MARKS = """() => {
    const chart = getElement(document.querySelector('[data-kv=timeline]').id.slice(1)).chart;
    const marks = {};
    const visit = (e) => {
        if (['fork', 'prune', 'finished'].includes(e.name)) {
            const r = e.getBoundingRect();
            (marks[e.name] = marks[e.name] || []).push([r.x, r.y, r.x + r.width, r.y + r.height]);
        }
        if (e.isGroup) for (const k of e.children()) visit(k);
    };
    for (const root of chart.getZr().storage.getRoots()) visit(root);
    const g = chart.getModel().getComponent('grid', 0).coordinateSystem.getRect();
    return {marks, plot: [g.x, g.y, g.x + g.width, g.y + g.height]};
}"""
# The x ranges of the batch chart's slot strip: the rectangles drawn in the slot colours.
SLOT_RUNS = """(fills) => {
    const chart = getElement(document.querySelector('[data-kv=batch]').id.slice(1)).chart;
    const runs = [];
    const visit = (e) => {
        if (e.type === 'rect' && e.style && fills.includes(e.style.fill)) {
            const r = e.getBoundingRect();
            runs.push([r.x, r.x + r.width]);
        }
        if (e.isGroup) for (const k of e.children()) visit(k);
    };
    for (const root of chart.getZr().storage.getRoots()) visit(root);
    return {runs};
}"""


def in_projector_mode(page, width: int, height: int) -> None:
    page.set_viewport_size({"width": width, "height": height})
    page.add_init_script("sessionStorage.setItem('kvscope-projector', '1')")  # as the header's switch leaves it


Point = tuple[float, float]


def intersect(a: list[Point], b: list[Point], slack: float = 1.0) -> bool:
    """Whether two convex boxes (corners in order) overlap by more than `slack` px: no edge of either
    separates them (the separating axis theorem; a rotated label's own box, not the box around it)."""
    for poly in (a, b):
        for (x0, y0), (x1, y1) in zip(poly, poly[1:] + poly[:1]):
            nx, ny = y0 - y1, x1 - x0
            norm = (nx * nx + ny * ny) ** 0.5 or 1.0
            pa = [(x * nx + y * ny) / norm for x, y in a]
            pb = [(x * nx + y * ny) / norm for x, y in b]
            if min(max(pa), max(pb)) - max(min(pa), min(pb)) <= slack:
                return False
    return True


def overlapping(texts: list[dict]) -> list[tuple[str, str]]:
    return [(a["text"], b["text"]) for i, a in enumerate(texts) for b in texts[i + 1:]
            if intersect(a["corners"], b["corners"])]


def finished_run(base: str, name: str, overrides: dict | None = None) -> str:
    run_id = api(base, "/api/runs", {"scenario": name, "speed": 0, "paused": False, "overrides": overrides or {}})["run_id"]
    wait_for(lambda: api(base, f"/api/runs/{run_id}")["finished"], f"{name} did not finish", 300)
    return run_id


def shot(page, name: str) -> None:
    if SHOTS:
        page.screenshot(path=f"{SHOTS}/projector-{name}.png")


@pytest.mark.parametrize("scenario", ["roofline", "beam-search"])
def test_projector_mode_text_is_16px_and_no_two_labels_overlap(page, backend_url, dashboard_url, scenario):
    """roofline: 512 requests on the timeline's axis; beam-search: sequences (the walk sees preemptions)."""
    run_id = finished_run(backend_url, scenario)
    in_projector_mode(page, *SIZES[0])
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.wait_for_function("window.kvscope && kvscope.latency.length > 0")
    for width, height in SIZES:
        page.set_viewport_size({"width": width, "height": height})
        m = measure_when(page, lambda m: laid_out(m, True, "single"))
        assert m["small"] == [], f"{width}x{height}: text under {PROJECTOR_PX} px: {m['small'][:8]}"
        wait_at_rest(page, f"{width}x{height}")  # the charts lay out again a frame after the resize
        shot(page, f"{scenario}-{width}x{height}")
        for kv, chart in page.evaluate(CHART_TEXTS).items():  # every chart, on screen or scrolled past
            small = [t for t in chart["texts"] if t["px"] < PROJECTOR_PX]
            assert not small and min(chart["option"], default=PROJECTOR_PX) >= PROJECTOR_PX, \
                f"{scenario} {width}x{height}: {kv} draws text under {PROJECTOR_PX} px: {small[:4]} {chart['option']}"
            assert overlapping(chart["texts"]) == [], f"{scenario} {width}x{height}: labels overlap in {kv}"
        assert page.evaluate(DOM_OVERLAPS) == [], f"{scenario} {width}x{height}: page labels overlap"


def test_projector_mode_draws_beam_marks_16px_across(page, backend_url, dashboard_url):
    run_id = finished_run(backend_url, "beam-search")
    in_projector_mode(page, *SIZES[0])
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.wait_for_function(f"() => ({MARKS})().marks.prune")
    drawn = page.evaluate(MARKS)
    marks, (left, top, right, bottom) = drawn["marks"], drawn["plot"]
    assert set(marks) == {"fork", "prune", "finished"}
    assert min(min(x1 - x0, y1 - y0) for boxes in marks.values() for x0, y0, x1, y1 in boxes) >= PROJECTOR_PX, marks
    cut = [(name, box) for name, boxes in marks.items() for box in boxes
           if box[0] < left - 1 or box[2] > right + 1 or box[1] < top - 1 or box[3] > bottom + 1]
    assert not cut, f"marks cut at the edge of the plot {drawn['plot']}: {cut}"


def test_the_slot_strip_draws_no_gap_where_every_iteration_held_its_slots(page, backend_url, dashboard_url):
    """Each iteration's slots, used or idle, are drawn: the strip is one unbroken band across the plot."""
    run_id = finished_run(backend_url, "continuous-batching")
    page.set_viewport_size({"width": SIZES[0][0], "height": SIZES[0][1]})
    page.goto(f"{dashboard_url}/?run={run_id}")
    fills = [SLOT_COLORS["used"], SLOT_COLORS["idle"]]
    page.wait_for_function(f"() => ({SLOT_RUNS})({fills!r}).runs.length > 1")
    strip = page.evaluate(SLOT_RUNS, fills)
    runs = sorted(strip["runs"])
    reach, gaps = runs[0][1], []
    for x0, x1 in runs[1:]:
        if x0 > reach + 0.5:
            gaps.append((round(reach, 1), round(x0, 1)))
        reach = max(reach, x1)
    assert not gaps, f"the slot strip has gaps (px) where the run held its slots: {gaps[:5]}"


def test_a_lesson_ring_is_16px_across_when_2048_blocks_make_the_cells_tiny(page, backend_url, dashboard_url):
    in_projector_mode(page, *SIZES[0])
    run_id = api(backend_url, "/api/runs", {"scenario": "beam-search", "speed": 0, "paused": True, "lesson": True,
                                            "overrides": {"engine.num_blocks": 2048}})["run_id"]
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.locator("[data-kv=lesson-continue]").click()  # to the fork: its shared blocks are ringed
    canvas = page.locator("[data-kv=block-pool] canvas")
    page.wait_for_function("(el) => (el.dataset.ringed || '') !== ''", arg=canvas.element_handle())
    wait_at_rest(page, "the ring drawn")
    ring = page.evaluate(f"""() => {{
        const pool = ({COMPONENT})('block-pool'), g = pool.geom;
        const b = Number(pool.$refs.canvas.dataset.ringed.split(' ')[0]);
        const cx = (b % g.cols) * g.cell + g.cell / 2, cy = Math.floor(b / g.cols) * g.cell + g.cell / 2;
        const ctx = pool.$refs.canvas.getContext('2d');
        const at = (x, y) => Array.from(ctx.getImageData(Math.round(x * g.dpr), Math.round(y * g.dpr), 1, 1).data.slice(0, 3));
        const left = Math.max(0, cx - g.ring / 2) + 1;  // inside the ring's outer line
        return {{cell: g.cell, ring: g.ring, edge: at(left, cy)}};
    }}""")
    dark = [int(ring_color("fork")[i:i + 2], 16) for i in (1, 3, 5)]  # a fork shares: the share colour
    assert ring["cell"] < PROJECTOR_PX <= ring["ring"], ring
    assert all(abs(a - b) <= 8 for a, b in zip(ring["edge"], dark)), ring
