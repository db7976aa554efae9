"""The page's JavaScript in a real browser (headless Chromium), without a dashboard: kvscope.js as the
page's head carries it (app.head_html, with palette.for_js's constants) and each of the views' Vue
components mounted alone, their functions called with small inputs built by the Python that feeds them
on the real page. Any page error, console error or Vue warning fails the test.

Skipped when /usr/bin/chromium is not installed (fixtures from tests/test_browser.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import nicegui
import pytest

from kvscope.backend.events.history import KINDS, Column
from kvscope.backend.phase import PHASES, SHOWN_PHASES
from kvscope.frontend.app import head_html
from kvscope.frontend.palette import (ALLREDUCE_COLOR, BLOCK_COLORS, FLASH_COLORS, FOCUS_COLOR, KIND_LABELS,
                                      PHASE_COLORS, REQUEST_COLORS)
from kvscope.frontend.views.batch import FOCUS_NONE, FOCUS_OTHER, FOCUS_SELECTED, PHASE, merge_columns
from kvscope.frontend.views.timeline import allreduce_item, merge_runs
from tests.test_browser import CHROMIUM, browser  # noqa: F401

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is not installed")

FRONTEND = Path(__file__).resolve().parents[1] / "frontend"
SCRIPTS = [FRONTEND / "static" / "kvscope.js", *sorted((FRONTEND / "views").glob("*.js"))]
# Vue's development build: it warns (a console warning this page fails on) where the production build is silent.
VUE = Path(nicegui.__file__).parent / "static" / "vue.esm-browser.js"
ORIGIN = "http://kvscope.test"  # answered by page.route, never by a network
# Each component with the props its Python element gives it (views/block_pool.py, views/live_text.py).
COMPONENTS = {
    "block_pool": {"palette": list(REQUEST_COLORS), "colors": {**BLOCK_COLORS, "flash": FLASH_COLORS,
                                                               "focus": FOCUS_COLOR}},
    "live_text": {"content": "a < b", "html": False},
}
# What Python sends each component, in the order a page does (run_method's names and arguments).
CALLS = {
    "block_pool": [("reset", {"state": [0, 1, 2, 1], "color": [0, 1, 0, 2], "marks": [0, 1, 4, 2], "focus": True,
                              "bytes_per_block": 1024}, {"stamp": [0, "block-pool"], "ack": "pool"}),
                   ("apply", [[0, 1, 3, 0, "alloc"], [9, 1, 0, 0, "free"]], None),
                   ("ring", [1, 3]), ("tip", 1, "block 1"), ("ring", [])],
    "live_text": [("set", "x > y")],
}
# Vue and the components are imported when a test first mounts one: kvscope.js's tests skip parsing them.
PAGE = f"""<!doctype html><html><head>{head_html()}</head><body>
<script>
const component = async (name) => (await import(`/${{name}}.js`)).default;
window.methodsOf = async (name) => Object.keys((await component(name)).methods || {{}});
window.mount = async (definition, props) => {{
  const Vue = await import("/vue.js");
  const el = document.body.appendChild(document.createElement("div"));
  el.style.cssText = "width: 320px; height: 200px";
  return Vue.createApp(typeof definition === "string" ? await component(definition) : definition, props).mount(el);
}};
// A method a Python element calls by name that is not a function any more: a field of the same name
// took its place (fields and methods share one namespace on a component instance).
window.shadowed = (vm, methods) => methods.filter((m) => typeof vm[m] !== "function");
</script></body></html>"""


def serve(route) -> None:
    path = route.request.url.removeprefix(ORIGIN)
    if path == "/":
        return route.fulfill(body=PAGE, content_type="text/html; charset=utf-8")
    files = {"/vue.js": VUE, **{f"/{name}.js": FRONTEND / "views" / f"{name}.js" for name in COMPONENTS}}
    if path not in files:
        return route.fulfill(status=404)
    return route.fulfill(body=files[path].read_text(encoding="utf-8"), content_type="text/javascript; charset=utf-8")


def is_error(message) -> bool:
    return message.type == "error" or (message.type == "warning" and "[Vue warn]" in message.text)


@pytest.fixture(scope="module")
def context(browser) -> Iterator[object]:  # noqa: F811
    context = browser.new_context(viewport={"width": 800, "height": 600})
    context.route(f"{ORIGIN}/**", serve)
    yield context
    context.close()


@pytest.fixture
def page(context) -> Iterator[object]:
    """A fresh tab (its own sessionStorage, nothing mounted) that fails the test on any error."""
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: is_error(m) and errors.append(f"console {m.type}: {m.text}"))
    page.set_default_timeout(10_000)
    page.goto(f"{ORIGIN}/")
    yield page
    page.close()
    assert not errors, f"JavaScript errors: {errors[:3]}"


def python_names(pattern: str) -> set[str]:
    """The names a regex's first group finds across the dashboard's Python."""
    return {m for path in FRONTEND.rglob("*.py") for m in re.findall(pattern, path.read_text(encoding="utf-8"))}


# ---- kvscope.js: one definition, in Python ------------------------------------------------------------------


def test_the_scripts_keep_no_list_of_phases_or_their_wordings():
    """A list or a map of two or more cell kinds in a script is a copy of backend/phase.py or
    palette.py, which the page receives from Python (for_js); so is a legend's wording."""
    alternatives = "|".join(KINDS)
    named = re.compile(rf"""["']({alternatives})["']|\b({alternatives})\s*:""")
    for script in SCRIPTS:
        text = script.read_text(encoding="utf-8")
        for span in re.findall(r"[\[{][^\[\]{}]*[\]}]", text):  # innermost brackets: a literal list or map
            kinds = {a or b for a, b in named.findall(span)}
            assert len(kinds) < 2, f"{script.name} lists {sorted(kinds)}: {span[:120]}"
        copied = [label for kind, label in KIND_LABELS.items() if label != kind and label in text]
        assert not copied, f"{script.name} repeats palette.KIND_LABELS: {copied}"


def test_the_page_has_python_s_phases_and_kinds(page):
    colors = page.evaluate("window.KVSCOPE_COLORS")
    assert colors["phases"] == list(SHOWN_PHASES) and set(PHASES) < set(colors["phases"])  # the engine's and recompute
    assert colors["kindNames"] == list(KINDS)
    assert colors["kinds"] == [PHASE_COLORS[kind] for kind in KINDS]


def test_every_helper_the_python_names_is_a_function_of_kvscope(page):
    """A chart option names its renderItem and formatter as "kvscope.x" strings: a helper renamed in
    one language only would leave an empty chart and no error until that chart drew."""
    names = python_names(r"""(?<![\w/.])kvscope\.([a-z]\w*)""") - {"backend", "frontend", "kernels", "scenarios",
                                                                   "js", "css"}
    assert {"timelineTip", "batchSeg", "bringIntoSight"} <= names  # the pattern still finds them
    missing = page.evaluate("(names) => names.filter((n) => typeof kvscope[n] !== 'function')", sorted(names))
    assert not missing


@pytest.mark.parametrize("kind", KINDS)
def test_a_timeline_tooltip_names_its_cell_in_the_legend_s_words(page, kind):
    index = KINDS.index(kind)
    [item] = merge_runs([[2.5, 3.5, 0, index, 16, 3, "r<1>"], [3.5, 4.5, 0, index, 1, 4, "r<1>"]])
    tip = page.evaluate("(v) => kvscope.timelineTip({seriesId: 'cells', value: v})", item)
    assert tip == f"<b>r&lt;1&gt;</b> · iterations 3–4<br>{KIND_LABELS[kind]} · 17 tokens"
    one = page.evaluate("(v) => kvscope.timelineTip({value: v})", [0, 1, 0, index, 1, 5, "a", 5])
    assert one.endswith(f"iteration 5<br>{KIND_LABELS[kind]} · 1 token")


@pytest.mark.parametrize("phase", SHOWN_PHASES)
def test_a_batch_segment_is_named_by_the_index_python_sends(page, phase):
    [item] = merge_columns([[step, 0, 8, 0, PHASE[phase], "r0", 8, FOCUS_NONE] for step in (6, 7)])
    tip = page.evaluate("(v) => kvscope.batchTip({seriesId: 'seg-0', value: v})", item)
    assert tip == f"<b>r0</b> · iterations 6–7<br>{phase}: 8 tokens per iteration"


FAKE_API = """(values) => ({ value: (i) => values[i], coord: ([x, y]) => [x * 10, 100 - y], size: () => [10, 1] })"""


def render(page, helper: str, value: list, plot: tuple[int, int, int, int] = (0, 0, 1000, 100)) -> dict:
    """What a custom series' renderItem returns for one item, given an axis of 10 px per x and 1 px per y
    and a plot of (x, y, width, height) px."""
    params = dict(zip(("x", "y", "width", "height"), plot))
    return page.evaluate(f"([v, plot]) => kvscope.{helper}({{coordSys: plot}}, ({FAKE_API})(v))", [value, params])


@pytest.mark.parametrize("kind", KINDS)
def test_a_timeline_cell_is_filled_in_its_kind_s_colour(page, kind):
    shape = render(page, "timelineCell", [0, 1, 5, KINDS.index(kind), 4, 0, "r"])
    assert shape["type"] == "rect" and shape["style"]["fill"] == PHASE_COLORS[kind]


def test_batch_segments_draw_prefill_solid_decode_pale_and_recompute_outlined(page):
    def style(phase: str, focus: int = FOCUS_NONE) -> dict:
        return render(page, "batchSeg", [0, 0, 0, 8, 1, PHASE[phase], "r", 8, focus])["style"]

    assert (style("prefill")["opacity"], style("prefill")["stroke"]) == (1, "#222")
    assert (style("decode")["opacity"], style("decode")["stroke"]) == (0.5, None)
    assert (style("recompute")["stroke"], style("recompute")["lineWidth"]) == (PHASE_COLORS["recompute"], 2)
    assert style("prefill")["fill"] == REQUEST_COLORS[1]
    assert style("prefill", FOCUS_OTHER)["opacity"] == 0.25 and style("prefill", FOCUS_SELECTED)["lineWidth"] == 2.5


def test_branch_lines_mark_forks_prunes_and_finishes(page):
    def marks(parent: int, end: int) -> list:
        kids = render(page, "branchLine", [0, 4, 1, 1, 2, parent, end, 3, "r", 2, "", 1])["children"]
        return [kid.get("name") for kid in kids if kid.get("name")]

    assert marks(-1, 0) == []
    assert marks(0, 1) == ["fork", "finished"]
    assert marks(0, 2) == ["fork", "prune", "prune"]
    # a branch from the plot's left edge to its right (0 to 40 px): both marks drawn whole inside it
    kids = render(page, "branchLine", [0, 4, 1, 1, 2, 0, 1, 3, "r", 2, "", 1], plot=(0, 0, 40, 100))["children"]
    fork, end = (next(k["shape"] for k in kids if k.get("name") == name) for name in ("fork", "finished"))
    assert fork["cx"] - fork["r"] >= 0 and end["cx"] + end["r"] <= 40, (fork, end)


def test_an_all_reduce_cell_fills_the_steps_share_and_its_tooltip_gives_the_figures(page):
    """A tensor-parallel step of 20 ms, 15 of them in its 12 all-reduces: three quarters of its outline filled."""
    step = Column(3, 1.0, 0.02, [], 2, 256, 4, {"count": 12, "bytes": 24576, "ms": 15.0})
    item = allreduce_item(step, None)
    outline, share = render(page, "allreduceCell", item)["children"]
    assert outline["style"]["fill"] is None and share["style"]["fill"] == ALLREDUCE_COLOR
    assert share["shape"]["width"] == pytest.approx(0.75 * outline["shape"]["width"])
    tip = page.evaluate("(v) => kvscope.timelineTip({seriesId: 'ar-live', value: v})", item)
    assert tip == ("<b>all-reduce</b> · iteration 3<br>15 ms of the step's 20 ms (75%)<br>12 all-reduces, 24.0 KiB "
                   "summed<br>rank 0's time in them, waiting for the slower rank included")


def test_a_mask_row_shows_cached_computed_and_masked_keys(page):
    row = [0, 0, 2, 4, 6]  # keys 0..1 cached, 2..4 computed now, 5 masked as the future
    fills = [kid["style"]["fill"] for kid in render(page, "maskRow", row)["children"]]
    assert fills == [page.evaluate(f"KVSCOPE_COLORS.mask.{k}") for k in ("masked", "cached", "computed")]
    tip = page.evaluate("(v) => kvscope.maskTip({value: v})", [*row, 0, "r<0>"])
    assert tip == ("<b>r&lt;0&gt;</b><br>query at position 4 attends to keys 0..4<br>keys 0..1 read from the KV "
                   "cache<br>keys 2..4 computed in this pass<br>keys 5..5 masked (future)")


def test_slot_bars_and_their_tooltips_count_idle_slots(page):
    assert len(render(page, "slotBar", [0, 3, 2, 4])["children"]) == 2
    assert len(render(page, "slotBar", [0, 3, 4, 4])["children"]) == 1
    tip = page.evaluate("(v) => kvscope.batchTip({seriesId: 'sl-0', value: v})", [0, 3, 2, 4])
    assert tip == "iterations 0–3<br>2 of 4 slots used<br><b>2 idle</b>"


@pytest.mark.parametrize("value, text", [(0, "0 s"), (2.5, "2.5 s"), (0.0021, "2.1 ms"), (2.5e-6, "2.5 µs")])
def test_seconds_are_written_in_a_readable_unit(page, value, text):
    assert page.evaluate("(v) => kvscope.seconds(v)", value) == text


@pytest.mark.parametrize("value, text", [(512, "512"), (1.5e12, "1.5T"), (2e15, "2P"), (3.3e3, "3.3k")])
def test_log_axes_count_in_si_steps(page, value, text):
    assert page.evaluate("(v) => kvscope.si(v)", value) == text


def test_the_roofline_tooltip_names_the_iteration_and_its_rates(page):
    tip = page.evaluate("(v) => kvscope.rooflineTip({seriesName: 'decode', value: v})",
                        [2.5, 3e12, 7, 41, 35, 2, 35, 6, False])
    assert tip == ("iteration 7 · decode<br>2.5 FLOP/byte<br>3TFLOP/s · 41 µs modelled<br>"
                   "= roofs 35 µs (compute 2 µs, memory 35 µs) + fixed cost 6 µs")
    measured = page.evaluate("(v) => kvscope.rooflineTip({seriesName: 'decode', value: v})",
                             [0.9, 8e9, 12, 21680, 7030, 1.5, 7030, 14650, True])
    assert measured.endswith("21.7 ms measured<br>= roofs 7.03 ms (compute 1.5 µs, memory 7.03 ms) + fixed cost 14.7 ms")
    assert "fixed cost" in page.evaluate("kvscope.rooflineTip({seriesId: 'fixed-roof', value: [1, 2]})")


def test_projector_mode_enlarges_the_marks_and_is_remembered(page):
    assert page.evaluate("kvscope.markPx()") == 10
    page.evaluate("kvscope.toggleProjector()")
    assert page.evaluate("[kvscope.markPx(), document.documentElement.classList.contains('kv-projector'), "
                         "sessionStorage.getItem('kvscope-projector')]") == [16, True, "1"]


def test_bring_into_sight_scrolls_to_a_card_and_ignores_a_missing_one(page):
    page.evaluate("""() => {
        document.body.insertAdjacentHTML("beforeend", '<div style="height: 3000px"></div><div id="c7">card</div>');
        kvscope.bringIntoSight("nowhere");
        kvscope.bringIntoSight("c7");
    }""")
    page.wait_for_function("() => window.scrollY > 2000")


def test_a_paint_is_timed_and_reported(page):
    page.evaluate("""() => new Promise((done) => {
        kvscope.lat(Date.now() - 5, "timeline");
        requestAnimationFrame(() => requestAnimationFrame(done));
    })""")
    # Recorded, and not below the 5 ms it began before (a lower bound only: no test bounds a wall clock).
    assert page.evaluate("kvscope.p95() !== null && kvscope.p95() + 0.5 > 5")


# ---- the views' components ------------------------------------------------------------------------------------


def test_every_component_is_tested_here():
    assert {path.stem for path in (FRONTEND / "views").glob("*.js")} == set(COMPONENTS) == set(CALLS)


def test_every_method_python_calls_is_a_component_s(page):
    called = python_names(r"""run_method\(\s*["'](\w+)["']""")
    assert called >= {name for calls in CALLS.values() for name, *_ in calls}
    assert called <= {m for name in COMPONENTS for m in page.evaluate("(c) => methodsOf(c)", name)}


@pytest.mark.parametrize("component", COMPONENTS)
def test_no_field_of_a_component_shadows_one_of_its_methods(page, component):
    """The block pool's lesson ring was a method `focus` and its blocks a field `focus`: assigned in
    mounted(), the field replaced the method, and Python's call failed only when a lesson paused."""
    shadowed = page.evaluate("""async ([name, props, calls]) => {
        const vm = await mount(name, props), methods = await methodsOf(name);
        const mounted = shadowed(vm, methods);
        for (const [method, ...args] of calls) if (typeof vm[method] === "function") vm[method](...args);
        return [mounted, shadowed(vm, methods)];
    }""", [component, COMPONENTS[component], CALLS[component]])
    assert shadowed == [[], []]


def test_the_shadowing_check_catches_the_focus_field(page):
    gone = page.evaluate("""async () => {
        const vm = await mount({ template: "<div></div>", methods: { focus() {} },
                                 mounted() { this.focus = new Set(); } });
        return shadowed(vm, ["focus"]);
    }""")
    assert gone == ["focus"]


def test_the_block_pool_paints_its_cells_and_rings_a_lesson_s_blocks(page):
    page.evaluate("""async ([props, calls]) => {
        const vm = await mount("block_pool", props);
        for (const [method, ...args] of calls.slice(0, 3)) vm[method](...args);
        window.vm = vm;
    }""", [COMPONENTS["block_pool"], CALLS["block_pool"]])
    canvas = page.locator("canvas")
    assert canvas.get_attribute("data-ringed") == "1 3" and canvas.get_attribute("data-blocks") == "4"
    page.wait_for_function("""() => {
        const c = document.querySelector("canvas");
        const data = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        return data.some((alpha, i) => i % 4 === 3 && alpha > 0);
    }""")
    page.evaluate("vm.ring([])")
    assert canvas.get_attribute("data-ringed") == ""


@pytest.mark.parametrize("html", [False, True])
def test_live_text_shows_its_content_as_text_or_as_html(page, html):
    shown = page.evaluate("""async (html) => {
        const vm = await mount("live_text", {content: "<b>a</b>", html});
        const first = vm.$el.innerHTML;
        vm.set("<i>b</i>");
        return [first, vm.$el.innerHTML];
    }""", html)
    assert shown == (["<b>a</b>", "<i>b</i>"] if html else ["&lt;b&gt;a&lt;/b&gt;", "&lt;i&gt;b&lt;/i&gt;"])
