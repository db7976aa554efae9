"""The dashboard in a real browser (headless Chromium): live views, stepping, export, latency.

The backend runs in this process (serve_in_thread) and the dashboard as `python -m kvscope.frontend` on
free loopback ports, exactly as `kvscope serve` wires them. Skipped when /usr/bin/chromium is not
installed (`.ci/run` installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvscope.backend.server.library import RunLibrary
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.serve import free_port
from tests.server_helpers import live_server, settled_snapshot, wait_for

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
# The README's picture: the screenshot test writes it to a temporary folder (a test leaves the tree as
# it found it), and here too when KVSCOPE_README_SCREENSHOT=1 (docs/testing.md).
README_SCREENSHOT = ROOT / "docs" / "images" / "dashboard.png"
# The page waits on conditions, never on a time budget: under CI load a first paint took over 20 s.
# How fast it paints is bench/latency.py's to measure (docs/benchmarks.md#dashboard).
TIMEOUT_MS = 120_000
WAIT_S = TIMEOUT_MS / 1000

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"{CHROMIUM} is not installed (apt-get install chromium)")
sync_api = pytest.importorskip("playwright.sync_api")


# ---- servers and browser ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend_url(tmp_path_factory) -> Iterator[str]:
    library = RunLibrary(tmp_path_factory.mktemp("library"))  # as `kvscope serve` keeps one
    with live_server(RunManager(limits=ServiceLimits(allow_paths=True), library=library)) as url:
        yield url


@pytest.fixture(scope="module")
def dashboard_url(backend_url: str) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "NICEGUI"))}  # not a test run
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.frontend", "--backend", backend_url, "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url) or proc.poll() is not None, "the dashboard did not start")
        if proc.poll() is not None:
            pytest.fail(f"the dashboard exited: {proc.stdout.read()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, dashboard_url):
    context = browser.new_context(viewport={"width": 1600, "height": 1000}, accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    context.close()
    assert not errors, f"JavaScript errors: {errors[:3]}"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def api(base: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.load(r)


def start(base: str, scenario: dict, speed: float, paused: bool) -> str:
    return api(base, "/api/runs", {"scenario": scenario, "speed": speed, "paused": paused})["run_id"]


def scenario(model: str, name: str, blocks: int, seqs: int, count: int, prompt: tuple[int, int],
             out: tuple[int, int], arrival: dict, budget: int = 256) -> dict:
    return {"name": name, "model": model, "seed": 0,
            "description": "Requests arriving over time; several share a prompt prefix.",
            "lesson": "Watch blocks being allocated, shared and freed while the batch changes.",
            "engine": {"block_size": 16, "num_blocks": blocks, "max_num_seqs": seqs, "max_num_batched_tokens": budget},
            "generate": {"count": count, "arrival": arrival, "prompt_tokens": {"min": prompt[0], "max": prompt[1]},
                         "max_tokens": {"min": out[0], "max": out[1]}, "shared_prefix": {"tokens": 32, "fraction": 0.5},
                         "sampling": {"temperature": 0.8, "top_p": 0.95, "seed": 7, "ignore_eos": True}}}


# ---- reading the page ---------------------------------------------------------------------------------

COMPONENT = ("(kv) => { const el = document.querySelector(`[data-kv='${kv}']`); "
             "return el && getElement(el.id.slice(1)); }")


def probe(page) -> dict:
    """What the views show right now, read from the browser's own chart and canvas objects."""
    return page.evaluate(f"""() => {{
        const c = {COMPONENT};
        const series = (kv) => c(kv).chart.getOption().series.reduce((n, s) => n + (s.data ? s.data.length : 0), 0);
        const end = (kv) => Math.max(-1, ...c(kv).chart.getOption().series
            .flatMap((s) => (s.data || []).map((d) => d[1])));
        const pool = c('block-pool');
        return {{
            blocks_in_use: pool.cells ? Array.from(pool.cells.state).filter((s) => s === 1).length : -1,
            timeline: series('timeline'),
            timeline_end: end('timeline'),
            batch: series('batch'),
            sampling_tokens: (c('sampling').chart.getOption().xAxis[0].data || []).length,
            latencies: window.kvscope.latency.length,
        }};
    }}""")


# The page at rest: every chart drawn at its element's size, with no animation running and no redraw due, and
# every block pool painted, with no flash running. A resize lays the charts out a frame later and a flash lasts
# 900 ms: a fixed pause for either is a guess, which a loaded machine makes wrong.
AT_REST = """() => Array.from(document.querySelectorAll('[data-kv]')).every((el) => {
    const c = window.getElement && getElement(el.id.slice(1));
    if (c && c.chart && !c.chart.isDisposed()) {
        const zr = c.chart.getZr();
        const sized = !el.clientWidth
            || (c.chart.getWidth() === el.clientWidth && c.chart.getHeight() === el.clientHeight);
        return sized && zr.animation.isFinished() && !zr._needsRefresh;
    }
    return !(c && c.flashes) || (!c.frame && !c.all && c.flashes.size === 0);
})"""


def wait_at_rest(page, what: str) -> None:
    wait_for(lambda: page.evaluate(AT_REST), f"the page came to rest: {what}")


def still_screenshot(page, path: Path) -> None:
    """A picture of the page at rest, once two in a row are the same (a tooltip's fade, a CSS transition)."""
    wait_at_rest(page, "for a picture")
    shots = [b""]

    def same_again() -> bool:
        shots[:] = [shots[-1], page.screenshot(full_page=False)]
        return shots[0] == shots[1]

    wait_for(same_again, "two pictures in a row the same")
    path.write_bytes(shots[1])


def status_step(page) -> int:
    text = page.locator("[data-kv=run-status]").inner_text()
    match = re.search(r"step (\d+)", text)
    return int(match.group(1)) if match else -1


# ---- the tests ------------------------------------------------------------------------------------------


def test_live_views_step_and_export(page, backend_url, dashboard_url, tiny_dir, tmp_path):
    run_id = start(backend_url, scenario(tiny_dir, "arrivals", 256, 6, 14, (24, 80), (20, 60),
                                         {"process": "poisson", "rate_per_step": 0.6}), speed=12, paused=True)
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.wait_for_function("window.kvscope && kvscope.latency.length > 0")
    before = probe(page)
    assert before["blocks_in_use"] == 0 and before["timeline"] == 0

    page.locator("[data-kv=play]").click()
    wait_for(lambda: status_step(page) >= 12, "the run did not advance")
    page.wait_for_function(f"""() => {{ const c = {COMPONENT};
        return c('sampling').chart.getOption().xAxis[0].data.length > 0; }}""")
    during = probe(page)
    assert during["blocks_in_use"] > 0 and during["timeline"] > 0 and during["batch"] > 0
    assert during["sampling_tokens"] > 0 and during["latencies"] > before["latencies"]

    # pause, then one step at a time: the status and the views move by exactly one iteration
    page.locator("[data-kv=play]").click()
    page.wait_for_function("() => document.querySelector('[data-kv=run-status]').innerText.includes('paused')")
    # the paused status and the timeline's last column arrive in updates of their own
    wait_for(lambda: probe(page)["timeline_end"] == status_step(page) + 0.5, "the timeline lags the status")
    step = status_step(page)
    assert probe(page)["timeline_end"] == step + 0.5  # cells span [step - 0.5, step + 0.5]
    page.locator("[data-kv=step]").click()
    wait_for(lambda: status_step(page) == step + 1, "step did not run one iteration")
    assert settled_snapshot(backend_url, run_id)["step"] == step + 1  # paused: exactly one iteration
    assert status_step(page) == step + 1  # the page, behind the server or level with it, never ahead
    wait_for(lambda: probe(page)["timeline_end"] == step + 1.5,
             "the timeline did not draw the stepped iteration")

    page.locator("[data-kv=export]").click()
    with page.expect_download(timeout=60_000) as download:
        page.get_by_text("Timeline PNG").click()
    png = tmp_path / "timeline.png"
    download.value.save_as(png)
    assert png.read_bytes().startswith(b"\x89PNG")


def test_the_page_keeps_answering_while_2048_blocks_and_64_requests_flood_it(page, backend_url, dashboard_url,
                                                                            tiny_dir):
    run_id = start(backend_url, scenario(tiny_dir, "stress", 2048, 64, 64, (16, 96), (100, 160),
                                         {"process": "burst"}, budget=2048), speed=0, paused=True)
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.wait_for_function("window.kvscope && kvscope.latency.length > 0")
    page.evaluate("kvscope.latency.length = 0")
    api(backend_url, f"/api/runs/{run_id}/control", {"action": "resume"})
    for i in range(6):  # the page must stay responsive while the engine floods it
        page.locator(".kv-help").first.click()
        page.locator(".kv-explain").first.wait_for(state="visible" if i % 2 == 0 else "hidden")
    wait_for(lambda: api(backend_url, f"/api/runs/{run_id}")["finished"], "the stress run did not finish", 600)
    page.wait_for_function("() => document.querySelector('[data-kv=run-status]').innerText.includes('finished')")
    updates = page.evaluate("kvscope.latency.length")
    assert updates > 20  # it painted as it went, not only at the end


def test_speculative_rows_p_vs_q_and_striped_draft_blocks(page, backend_url, dashboard_url, tiny_dir):
    spec = scenario(tiny_dir, "speculative", 256, 4, 3, (16, 32), (40, 60), {"process": "burst"})
    spec["engine"]["speculative"] = {"method": "draft", "draft_model": "demo-draft", "num_tokens": 4}
    page.goto(f"{dashboard_url}/?run={start(backend_url, spec, speed=4, paused=False)}")
    page.wait_for_function(f"""() => {{ const pool = ({COMPONENT})('block-pool');
        return pool.cells && Array.from(pool.cells.marks).some((m) => m & 2); }}""")  # the draft's blocks
    page.locator(".kv-tok-acc, .kv-tok-rej").first.wait_for()
    page.locator(".kv-tok-res, .kv-tok-bonus").first.click()
    page.wait_for_function(f"""() => {{ const s = ({COMPONENT})('spec-pq').chart.getOption().series;
        return s.length === 2 && s[0].data.length > 0; }}""")
    assert "p = " in page.locator("[data-kv=spec-pq-caption]").inner_text() or \
        "bonus position" in page.locator("[data-kv=spec-pq-caption]").inner_text()


def test_an_unknown_run_says_no_such_run_and_links_home(page, dashboard_url):
    page.goto(f"{dashboard_url}/?run=nope")
    page.get_by_text("No such run: nope").wait_for()
    assert page.locator("[data-kv=run-status]").count() == 0  # no views waiting on "reconnecting"
    page.get_by_text("← all runs").click()
    page.get_by_text("Watch an LLM inference engine think").wait_for()
    assert page.url.rstrip("/") == dashboard_url


def test_the_run_library_on_the_landing_page_opens_renames_and_deletes(page, backend_url, dashboard_url, tiny_dir,
                                                                      tmp_path):
    run_id = start(backend_url, scenario(tiny_dir, "prepared-ahead", 64, 4, 3, (16, 32), (8, 12),
                                         {"process": "burst"}), speed=0, paused=False)
    wait_for(lambda: any(e["id"] == run_id for e in api(backend_url, "/api/library")["entries"]),
             "the finished run was not saved")
    page.goto(dashboard_url)
    entry = page.locator("[data-kv=library-entry]", has_text="prepared-ahead").first
    entry.wait_for()
    facts = entry.locator("[data-kv=library-facts]").inner_text()
    steps = api(backend_url, f"/api/runs/{run_id}")["step"]
    assert entry.locator("[data-kv=library-name]").inner_text() == "prepared-ahead"
    assert re.match(r"20\d\d-\d\d-\d\d \d\d:\d\d · ", facts) and f" · {steps} steps · 3 requests" in facts
    page.locator("[data-kv=library]").screenshot(path=str(Path(SHOTS or tmp_path) / "run-library.png"))

    entry.locator("[data-kv=library-rename]").click()
    page.locator("[data-kv=library-rename-save]").wait_for()
    page.screenshot(path=str(Path(SHOTS or tmp_path) / "run-library-rename.png"), full_page=True)
    page.locator("input[data-kv=library-name-input], [data-kv=library-name-input] input").fill("Lecture 4: bursts")
    page.locator("[data-kv=library-rename-save]").click()
    renamed = page.locator("[data-kv=library-entry]", has_text="Lecture 4: bursts")
    renamed.wait_for()
    assert api(backend_url, f"/api/library/{run_id}")["name"] == "Lecture 4: bursts"

    renamed.locator("[data-kv=library-open]").click()  # a replay, paused at its start
    page.wait_for_url(re.compile(r"\?run=(?!" + run_id + ")[0-9a-f]{12}$"))
    page.wait_for_function("() => document.querySelector('[data-kv=run-status]')?.innerText.includes('paused')")
    replay = api(backend_url, f"/api/runs/{page.url.rsplit('=', 1)[1]}")
    assert replay["kind"] == "replay" and replay["paused"] and replay["step"] == -1

    page.goto(dashboard_url)
    page.locator("[data-kv=library-entry]", has_text="Lecture 4: bursts").locator("[data-kv=library-delete]").click()
    page.locator("[data-kv=library-delete-confirm]").click()
    page.locator("[data-kv=library-entry]", has_text="Lecture 4: bursts").wait_for(state="detached")
    assert all(e["id"] != run_id for e in api(backend_url, "/api/library")["entries"])


# ---- layout: nothing overflows, projector mode ---------------------------------------------------------

VIEWPORTS = ((1280, 800), (1600, 1000), (1920, 1080))
SHOTS = os.environ.get("KVSCOPE_SHOTS")  # a folder: every layout checked below is saved there to look at
PROJECTOR_PX = 16
MEASURE = """() => {
    const inner = window.innerWidth;
    const visible = (el) => el.getClientRects().length && getComputedStyle(el).visibility !== "hidden";
    const own = (el) => Array.from(el.childNodes).some((n) => n.nodeType === 3 && n.textContent.trim());
    const small = [];
    for (const el of document.body.querySelectorAll("*")) {
        if (!own(el) || !visible(el) || el.closest(".q-icon, .material-icons")) continue;
        const px = parseFloat(getComputedStyle(el).fontSize);
        if (px < %d) small.push(`${el.className || el.tagName}: ${el.textContent.trim().slice(0, 30)} (${px}px)`);
    }
    const outside = [];
    for (const el of document.querySelectorAll(".kv-header .q-btn, .kv-header [data-kv], .kv-header .q-select")) {
        const r = el.getBoundingClientRect();
        if (visible(el) && (r.left < 0 || r.right > inner)) outside.push(el.dataset.kv || el.className);
    }
    const drawer = document.querySelector(".kv-drawer");
    const edge = drawer && drawer.getBoundingClientRect().right;
    for (const el of (drawer && edge > 0 ? drawer.querySelectorAll(".q-btn, .q-field, .kv-legend-item") : [])) {
        if (visible(el) && el.getBoundingClientRect().right > edge + 1) outside.push(el.textContent.trim().slice(0, 30));
    }
    const fonts = [];
    for (const el of document.querySelectorAll("[data-kv]")) {
        const c = window.getElement && getElement(el.id.slice(1));
        const o = c && c.chart && c.chart.getOption();
        if (!o) continue;
        for (const a of [...o.xAxis, ...o.yAxis]) fonts.push(a.axisLabel.fontSize, a.nameTextStyle.fontSize || 12);
        for (const l of o.legend || []) fonts.push(l.textStyle.fontSize);
    }
    const pool = document.querySelector("[data-kv=block-pool]");
    const geom = pool && getElement(pool.id.slice(1)).geom;
    return {scroll: document.documentElement.scrollWidth, inner, small, outside, chart_font: Math.min(...fonts),
            pool_numbers: geom ? geom.numbers : null, projector: document.documentElement.classList.contains("kv-projector")};
}""" % PROJECTOR_PX


def laid_out(m: dict, projector: bool, layout: str) -> bool:
    """What the checks below want of a measurement: the page settled in the mode asked for."""
    fits = m["projector"] == projector and m["scroll"] <= m["inner"] and not m["outside"]
    big = not m["small"] and (layout == "home" or m["chart_font"] >= PROJECTOR_PX)
    return fits and (big or not projector)


def measure_when(page, settled: Callable[[dict], bool]) -> dict:
    """MEASURE once the page has settled (or the last one, at the deadline, for the asserts to name)."""
    deadline = time.monotonic() + WAIT_S
    while not settled(m := page.evaluate(MEASURE)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return m


def shared_prefix_run(base: str, model: str, caching: bool, steps: int) -> str:
    """The shared-prefix lesson with the tiny model, stopped mid-way after `steps` iterations."""
    run_id = api(base, "/api/runs", {"scenario": "shared-prefix", "speed": 0, "paused": True,
                                     "overrides": {"model": model, "engine.prefix_caching": caching}})["run_id"]
    if steps:
        api(base, f"/api/runs/{run_id}/control", {"action": "step", "value": steps})
        wait_for(lambda: api(base, f"/api/runs/{run_id}")["step"] >= steps - 1, "the run did not step")
    return run_id


@pytest.fixture(scope="module")
def midway(backend_url: str, tiny_dir: str) -> tuple[str, str]:
    return shared_prefix_run(backend_url, tiny_dir, True, 14), shared_prefix_run(backend_url, tiny_dir, False, 14)


@pytest.mark.parametrize("layout", ["home", "single", "side-by-side"])
def test_nothing_overflows_at_1280_and_projector_mode_makes_every_label_16px(page, backend_url, dashboard_url, midway,
                                                                             layout):
    path = {"home": "/", "single": f"/?run={midway[0]}", "side-by-side": f"/?run={midway[0]}&compare={midway[1]}"}
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(dashboard_url + path[layout])
    if layout != "home":
        page.wait_for_function("window.kvscope && kvscope.latency.length > 0")
    for projector in (False, True):
        if projector:
            page.locator("[data-kv=projector]").click()
        for width, height in VIEWPORTS:
            page.set_viewport_size({"width": width, "height": height})
            # the charts' fonts and the block pool's layout follow a resize or the switch a few frames later
            m = measure_when(page, lambda m: laid_out(m, projector, layout))
            if SHOTS:
                if layout == "home":  # the drawer's compare section, the bottom of the panel
                    page.get_by_text("Side by side").scroll_into_view_if_needed()
                page.mouse.move(width - 2, height - 2)
                page.screenshot(path=f"{SHOTS}/{layout}-{width}x{height}{'-projector' if projector else ''}.png")
            assert m["projector"] == projector
            assert m["scroll"] <= m["inner"], f"{width}x{height}: the page is wider than the window"
            assert m["outside"] == [], f"{width}x{height}: outside the window or the panel: {m['outside']}"
            if projector:
                assert m["small"] == [], f"{width}x{height}: text under {PROJECTOR_PX} px: {m['small'][:8]}"
                if layout != "home":
                    assert m["chart_font"] >= PROJECTOR_PX
                    assert m["pool_numbers"] == 0 or m["pool_numbers"] >= PROJECTOR_PX  # else the tooltip names it
    if layout == "side-by-side":  # one x scale for both columns: the longer run's iterations so far
        ends = page.evaluate("""() => Array.from(document.querySelectorAll("[data-kv=timeline], [data-kv=batch]"))
            .map((el) => getElement(el.id.slice(1)).chart.getOption().xAxis.map((a) => a.max)).flat()""")
        last = max(api(backend_url, f"/api/runs/{r}")["step"] for r in midway)
        assert ends == [last + 0.5] * 6
    page.reload()  # remembered for the session
    assert measure_when(page, lambda m: m["projector"])["projector"]
    page.locator("[data-kv=projector]").click()
    m = measure_when(page, lambda m: not m["projector"] and m["small"])
    assert not m["projector"] and m["small"]  # back to the normal, smaller type


def test_readme_screenshot_is_the_shared_prefix_lesson_mid_way(page, backend_url, dashboard_url, tmp_path):
    """docs/images/dashboard.png: the demo model's shared-prefix run, 14 iterations in, at 1600x1000."""
    run_id = shared_prefix_run(backend_url, "demo", True, 0)
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.wait_for_function("window.kvscope && kvscope.latency.length > 0")
    # started without lesson mode: the picture is of the run, not of a lesson's pause
    assert api(backend_url, f"/api/runs/{run_id}")["lesson"] is False
    # stepped while watched: the figures come from the events (a snapshot has no past throughput)
    api(backend_url, f"/api/runs/{run_id}/control", {"action": "step", "value": 14})
    wait_for(lambda: status_step(page) == 13, "the run did not step")
    page.wait_for_function(f"""() => {{ const c = {COMPONENT};
        return c('timeline').chart.getOption().series.some((s) => (s.data || []).length > 0); }}""")
    page.mouse.move(800, 5)  # no tooltip in the picture
    shot = tmp_path / "dashboard.png"
    still_screenshot(page, shot)
    assert 20_000 < shot.stat().st_size < 500_000
    if os.environ.get("KVSCOPE_README_SCREENSHOT") == "1":
        shutil.copyfile(shot, README_SCREENSHOT)


def test_a_lesson_pause_rings_the_blocks_it_names_until_continue(page, backend_url, dashboard_url, tiny_dir):
    """memory-pressure's first preemption: the freed blocks are ringed (no page error: the fixture fails on any)
    and stay ringed while the lesson waits; continue clears them."""
    run_id = api(backend_url, "/api/runs", {"scenario": "memory-pressure", "speed": 0, "paused": True,
                                            "lesson": True, "overrides": {"model": tiny_dir}})["run_id"]
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.locator("[data-kv=lesson-continue]").click()  # past the first step, to the preemption
    wait_for(lambda: api(backend_url, f"/api/runs/{run_id}")["num_preemptions"] >= 1, "no preemption")
    canvas = page.locator("[data-kv=block-pool] canvas")
    page.wait_for_function("(el) => (el.dataset.ringed || '') !== ''", arg=canvas.element_handle())
    ringed = canvas.get_attribute("data-ringed")
    step = api(backend_url, f"/api/runs/{run_id}")["step"]
    wait_at_rest(page, "every flash ended")  # the ring is not one
    assert canvas.get_attribute("data-ringed") == ringed and settled_snapshot(backend_url, run_id)["step"] == step
    page.reload()  # a lecturer's reload while the lesson waits: the page shows the moment the run is held at
    page.locator("[data-kv=lesson-continue]").wait_for()
    assert "First preemption" in page.locator("[data-kv=lesson-progress]").inner_text()
    page.wait_for_function("([el, ringed]) => el.dataset.ringed === ringed", arg=[canvas.element_handle(), ringed])
    page.locator("[data-kv=lesson-continue]").click()
    page.wait_for_function("([el, before]) => el.dataset.ringed !== before", arg=[canvas.element_handle(), ringed])


def test_a_lesson_pause_scrolls_the_view_it_names_into_sight(page, backend_url, dashboard_url):
    """speculative-draft's rejected draft: the speculative card sits far below a 1280x720 window's fold."""
    page.set_viewport_size({"width": 1280, "height": 720})
    run_id = api(backend_url, "/api/runs", {"scenario": "speculative-draft", "speed": 0, "paused": True,
                                            "lesson": True})["run_id"]
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.locator("[data-kv=lesson-continue]").click()
    page.wait_for_function("""() => {
        const card = document.querySelector('.kv-focus');
        if (!card) return false;
        const box = card.getBoundingClientRect();
        return box.top >= 0 && box.top < window.innerHeight && box.bottom > 0;
    }""")
    assert page.evaluate("window.scrollY") > 0  # it was below the fold: the page scrolled to it


def first_token_of(page, backend_url: str, dashboard_url: str, scenario: str, request: str) -> None:
    """A finished demo run of the scenario, its request picked and the request's first token clicked."""
    run_id = api(backend_url, "/api/runs", {"scenario": scenario, "speed": 0, "overrides": {"model": "demo"}})["run_id"]
    wait_for(lambda: api(backend_url, f"/api/runs/{run_id}")["finished"], "the run did not finish")
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.locator(".q-select").filter(has=page.get_by_text("request", exact=True)).first.click()
    page.get_by_role("option", name=request, exact=True).click()
    page.locator("[data-kv=token-strip] [data-i='0']").first.click()
    # the request's last token was drawn (and its row fetched) first: wait for the click's redraw
    page.locator("[data-kv=token-strip] [data-i='0'].kv-tok-selected").first.wait_for()


def test_the_sampling_view_shows_every_stage_of_a_demo_distribution_on_a_log_scale(page, backend_url, dashboard_url):
    """sampling-knobs on the demo: on the log scale the bars grow from its floor (ECharts grows them from 1),
    each cut named with the mass it removed, the rest of the vocabulary its own bar, computed exactly."""
    first_token_of(page, backend_url, dashboard_url, "sampling-knobs", "min-p")
    exactness = page.locator("[data-kv=sampling-exactness]")
    page.wait_for_function("(el) => el.innerText.startsWith('exact')", arg=exactness.element_handle())
    assert "(2,048 tokens)" in exactness.inner_text()
    assert re.search(r"min-p removed [1-9]\d?%", page.locator("[data-kv=sampling-cuts]").inner_text())
    page.locator("[data-kv=sampling-scale]").get_by_text("log").click()
    page.wait_for_function(f"() => ({COMPONENT})('sampling').chart.getOption().yAxis[0].type === 'log'")
    chart = page.evaluate(f"""() => {{
        const option = ({COMPONENT})('sampling').chart.getOption();
        return {{axis: option.yAxis[0], labels: option.xAxis[0].data.map((d) => d.value ?? d),
                series: option.series.map((s) => ({{name: s.name, data: s.data}}))}};
    }}""")
    assert chart["axis"]["startValue"] == chart["axis"]["min"] > 0  # bars grow from the floor, not from 1
    assert chart["labels"][-1].startswith("other (2,0")
    names = [s["name"] for s in chart["series"]]
    assert names[:4] == ["raw (T = 1)", "after temperature", "after top-k", "after top-p"]
    assert re.fullmatch(r"after min-p = final \(−\d+%\)", names[4])
    for s in chart["series"][:5]:  # every stage has bars above the floor, the tail included where it keeps mass
        assert sum(1 for v in s["data"] if v is not None) >= 2, s["name"]
    assert chart["series"][0]["data"][-1] > 0.01  # the raw tail: its own labelled bar


def test_the_sampling_view_shows_a_grammars_mask_as_its_first_stage(page, backend_url, dashboard_url, tmp_path):
    """structured-output on the demo: person's first token drawn under a JSON schema. The chart starts
    with the model's own distribution, its favourites marked as masked; the line under it names the
    grammar and the JSON path; the timeline and the picker tag the request with its grammar."""
    first_token_of(page, backend_url, dashboard_url, "structured-output", "person · {json}")  # the picker's tag
    grammar = page.locator("[data-kv=sampling-grammar]")
    page.wait_for_function("(el) => el.innerText === 'grammar: JSON schema · writing $'", arg=grammar.element_handle())
    assert re.search(r"the grammar allowed \d+ tokens? and removed \d+(\.\d)?% of the model's mass",
                     page.locator("[data-kv=sampling-cuts]").inner_text())
    chart = page.evaluate(f"""() => {{
        const option = ({COMPONENT})('sampling').chart.getOption();
        return {{labels: option.xAxis[0].data.map((d) => d.value ?? d), names: option.series.map((s) => s.name),
                 timeline: ({COMPONENT})('timeline').chart.getOption().yAxis[0].data.map((d) => d.value ?? d)}};
    }}""")
    assert chart["names"][0] == "model (T = 1)" and chart["names"][1].startswith("after the grammar's mask (−")
    assert chart["names"][2:6] == ["after temperature", "after top-k", "after top-p", "after min-p = final"]
    assert any(label.startswith("✕ ") for label in chart["labels"]), "the model's favourites are marked masked"
    assert "▶ {" in chart["labels"], "the chosen token is the object's brace"
    assert set(chart["timeline"]) == {"person · {json}", "date · /regex/", "verdict · choice"}
    texts = page.locator("[data-kv=token-strip] [data-i]").all_inner_texts()
    after_colon = next(i for i in range(len(texts)) if ":" in "".join(texts[:i]))  # the first key's value
    page.locator(f"[data-kv=token-strip] [data-i='{after_colon}']").first.click()
    page.wait_for_function("(el) => el.innerText === 'grammar: JSON schema · writing $.name'",
                           arg=grammar.element_handle())
    page.screenshot(path=f"{SHOTS or tmp_path}/sampling-grammar.png", full_page=True)


def test_exporting_a_gif_shows_a_progress_bar_that_fills_and_the_slide_downloads(page, backend_url, dashboard_url,
                                                                                tiny_dir, tmp_path):
    from PIL import Image

    run_id = start(backend_url, scenario(tiny_dir, "gif", 256, 4, 6, (16, 40), (20, 30),
                                         {"process": "uniform", "rate_per_step": 0.5}), speed=0, paused=False)
    wait_for(lambda: api(backend_url, f"/api/runs/{run_id}")["finished"], "the run did not finish")
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.wait_for_function("window.kvscope && kvscope.latency.length > 0")  # painted: its buttons answer clicks
    page.wait_for_function("() => document.querySelector('[data-kv=run-status]').innerText.includes('finished')")
    bar = page.locator("[data-kv=export-progress]")
    assert not bar.is_visible()
    page.evaluate("""() => { window.kvProgress = [];  // every value the bar shows, as the server sends them
        new MutationObserver(() => kvProgress.push(Number(
            document.querySelector('[data-kv=export-progress]').getAttribute('aria-valuenow'))))
          .observe(document.querySelector('[data-kv=export-progress]'), {attributes: true,
                                                                          attributeFilter: ['aria-valuenow']}); }""")
    page.locator("[data-kv=export]").click()
    with page.expect_download(timeout=TIMEOUT_MS) as download:
        page.get_by_text("Run as GIF").click()
        bar.wait_for(state="visible")
    gif = tmp_path / "run.gif"
    download.value.save_as(gif)
    with Image.open(gif) as image:
        assert image.size == (1920, 1080) and image.n_frames > 1
    seen = page.evaluate("kvProgress")
    assert seen[-1] == 1 and any(0 < v < 1 for v in seen), seen  # it moved while rendering, then filled
    assert page.locator("[data-kv=export-status-label]").inner_text().startswith(f"✓ kvscope-{run_id}-run.gif")


ROOFLINE_STATE = f"""() => {{ const c = ({COMPONENT})('roofline').chart, o = c.getOption();
    const i = o.series.findIndex((s) => !['roof', 'fixed-roof', 'other-run'].includes(s.id) && (s.data || []).length);
    if (i < 0) return null;
    c.dispatchAction({{type: 'showTip', seriesIndex: i, dataIndex: 0}});  // what hovering the first point shows
    const tip = [...c.getDom().querySelectorAll('div')].map((d) => d.innerText).find((t) => t.includes('FLOP/byte'));
    return {{tip: tip || '', fixed: (o.series.find((s) => s.id === 'fixed-roof') || {{data: []}}).data.length}}; }}"""


@pytest.mark.parametrize("viewport", [(1280, 720), (1920, 1080)])
def test_the_roofline_on_this_machine_draws_the_steps_as_measured_with_their_fixed_cost(
        page, backend_url, dashboard_url, tiny_dir, viewport):
    """#36: the third limit on screen. A run that ran here, priced on this-machine: the caption quotes the
    decode steps' measured fixed cost, the dashed roofs-with-fixed-cost line is drawn, and hovering a point
    splits its measured time into the roofs' (compute, memory) and the fixed cost."""
    page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
    run_id = start(backend_url, scenario(tiny_dir, "fixed-cost", 64, 2, 3, (16, 24), (8, 12), {"process": "burst"}),
                   speed=0, paused=False)
    wait_for(lambda: api(backend_url, f"/api/runs/{run_id}")["finished"], "the run did not finish")
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.locator("[data-kv=hardware-picker]").click()
    page.get_by_role("option", name="this-machine", exact=True).click()  # measured once (~4 s) if not cached
    caption = page.locator("[data-kv=roofline-caption]")
    caption.get_by_text("per decode step (measured: the engine's clock").wait_for()
    assert re.search(r"fixed cost [\d.,]+ ms per decode step \(measured: the engine's clock; the step took [\d.,]+ ms, "
                     r"its roofs allow [\d.,]+ ms\)", caption.inner_text())
    page.locator("[data-kv=roofline]").scroll_into_view_if_needed()
    page.wait_for_function(f"() => {{ const s = ({ROOFLINE_STATE})(); return s && s.fixed > 0 && s.tip; }}")
    shown = page.evaluate(ROOFLINE_STATE)
    time = r"[\d.]+ (µs|ms|s)"
    assert re.search(rf"{time} measured\n= roofs {time} \(compute {time}, memory {time}\) \+ fixed cost {time}",
                     shown["tip"]), shown
    box, screen = page.locator("[data-kv=roofline]").bounding_box(), page.viewport_size
    assert box["width"] > 200 and box["x"] >= 0 and box["x"] + box["width"] <= screen["width"]
    if SHOTS:
        page.screenshot(path=f"{SHOTS}/roofline-{viewport[0]}.png")


def test_the_keys_a_lecturer_reaches_for(page, backend_url, dashboard_url, tiny_dir):
    """#38: space / → continue a lesson (else play / step), P projector, F full screen of the named view, ?
    the keys' help; a key typed into a field stays there."""
    run_id = api(backend_url, "/api/runs", {"scenario": "memory-pressure", "speed": 0, "paused": True,
                                            "lesson": True, "overrides": {"model": tiny_dir}})["run_id"]
    page.goto(f"{dashboard_url}/?run={run_id}")
    page.locator("[data-kv=lesson-continue]").wait_for()
    page.keyboard.press("Space")  # the lesson's continue: on to its first preemption
    wait_for(lambda: api(backend_url, f"/api/runs/{run_id}")["num_preemptions"] >= 1, "space did not continue")
    page.wait_for_function("() => document.querySelector('.kv-focus') !== null")  # the step names a view
    page.keyboard.press("f")
    page.wait_for_function("() => document.fullscreenElement && document.fullscreenElement.classList.contains('kv-focus')")
    page.keyboard.press("f")
    page.wait_for_function("() => document.fullscreenElement === null")
    page.keyboard.press("p")
    assert page.evaluate("document.documentElement.classList.contains('kv-projector')")
    page.keyboard.press("P")
    assert not page.evaluate("document.documentElement.classList.contains('kv-projector')")
    page.keyboard.press("?")
    assert "projector mode" in page.locator("[data-kv=shortcuts]").inner_text()
    page.keyboard.press("Escape")
    assert page.locator("[data-kv=shortcuts]").count() == 0
    page.locator("[data-kv=shortcuts-button]").click()  # the header's button opens the same help
    for width, height in ((1280, 720), (1920, 1080)):
        page.set_viewport_size({"width": width, "height": height})
        box = page.locator("[data-kv=shortcuts]").bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= width and box["y"] + box["height"] <= height
        if SHOTS:
            page.screenshot(path=f"{SHOTS}/keys-{width}.png")

    no_lesson = scenario(tiny_dir, "keys", 64, 2, 2, (16, 24), (8, 12), {"process": "burst"})
    del no_lesson["lesson"]  # without a lesson the keys drive the run's own controls
    plain = start(backend_url, no_lesson, speed=1, paused=True)
    page.goto(f"{dashboard_url}/?run={plain}")
    page.locator("[data-kv=play]").wait_for()
    page.wait_for_function("window.kvscope && kvscope.latency.length > 0")  # painted: its buttons answer clicks
    before = api(backend_url, f"/api/runs/{plain}")["step"]
    page.keyboard.press("ArrowRight")  # no lesson: one iteration
    wait_for(lambda: api(backend_url, f"/api/runs/{plain}")["step"] == before + 1, "→ did not step once")
    prompt = page.locator("input[data-kv=prompt], [data-kv=prompt] input").first
    prompt.click()
    page.keyboard.type("a b ")  # typing: the space goes into the field, the run stays paused
    assert (api(backend_url, f"/api/runs/{plain}")["paused"], prompt.input_value()) == (True, "a b ")
    prompt.blur()
    page.keyboard.press("Space")  # no lesson: play
    wait_for(lambda: not api(backend_url, f"/api/runs/{plain}")["paused"], "space did not play")


@pytest.mark.parametrize("viewport", [(1280, 720), (1366, 768)])
def test_start_run_stays_in_sight_however_long_the_drawer_grows(page, dashboard_url, viewport):
    """#38: at 1280x720 the Start run button sat below the fold under a long lesson text and the engine form."""
    page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
    page.goto(dashboard_url)
    page.locator("[data-kv=scenario]").click()
    page.get_by_role("option", name="quantized-weights", exact=True).click()  # the longest description
    page.get_by_role("button", name="Expand \"Engine configuration\"").click()  # the engine form opens above it
    page.wait_for_function("() => document.querySelector('[data-kv=scenario-about]').innerText.length > 100")
    button = page.locator("[data-kv=start-run]")
    box = button.bounding_box()
    assert 0 <= box["y"] and box["y"] + box["height"] <= viewport[1], box
    assert page.evaluate("(el) => { const r = el.getBoundingClientRect(); "
                         "return document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2)?.closest('button') === el; }",
                         button.element_handle())  # on top, not under the form
    if SHOTS:
        page.screenshot(path=f"{SHOTS}/start-run-{viewport[0]}.png")
