"""Compare and KV usage on the page, under NiceGUI's simulated user against a real backend; and the
compare page in a real browser (headless Chromium; tests/test_browser.py's `page` fails a test on any
page error or console error)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.backend.events.state import RunState
from kvscope.backend.server.library import RunLibrary
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import live_server, settled_feed, until, wait_for
from tests.test_browser import CHROMIUM, api, browser, dashboard_url, page, scenario, start, wait_at_rest  # noqa: F401
from tests.test_dashboard import (Dash, assert_no_error_logs, backend_url, dash, nicegui_storage, simulated,  # noqa: F401
                                  synthetic_column, until_run)


def cuts(events: list[dict], steps: tuple[int, ...]) -> list[int]:
    """Event counts to stop the feed at: each step's end (its metrics event), and inside the next step
    right after its first block allocation (where a view that read the last metrics event fell behind)."""
    out = []
    for step in steps:
        end = next(i for i, e in enumerate(events) if e["type"] == "metrics" and e["step"] == step) + 1
        alloc = next((i for i, e in enumerate(events) if i >= end and e["type"] == "block_alloc"), None)
        out += [end] + ([alloc + 1] if alloc is not None else [])
    return out


async def check_kv_usage_agrees(dash: Dash, events: list[dict], steps: tuple[int, ...]) -> None:
    column = await synthetic_column(dash, events[:1])
    feed, metrics, pool = column.feed, column.views["metrics"], column.views["blocks"]
    fed = 1
    for cut in cuts(events, steps):
        for e in events[fed:cut]:
            feed.handle(e)
        fed = cut
        await until(lambda: all(v.version == feed.version for v in column.views.values()))
        state = RunState()
        for e in events[:cut]:
            state.apply(e)
        used, n = state.num_blocks - len(state.free_blocks), state.num_blocks
        percent = f"{100 * used / n:.0f}%"
        assert f"in use {used} ({percent})" in pool.caption.content, (cut, pool.caption.content)
        assert metrics.kpis["usage"] == percent, (cut, metrics.kpis["usage"], pool.caption.content)
        last = events[cut - 1]
        if last["type"] == "metrics":  # an iteration's end: its event, its chart point and the state agree
            assert round(last["kv_usage"] * n) == used
            assert metrics.last_point["kv_usage"] == [last["step"], round(100 * last["kv_usage"], 2)]


async def test_kv_usage_is_the_same_in_the_pool_the_headline_and_the_chart_at_every_step(
        dash: Dash, tiny_dir: str) -> None:
    """metrics 33% used vs pool 34% (#22): the headline read the last iteration's metrics event while the
    pool had the next iteration's first allocations; both read the blocks held now."""
    from kvscope.frontend.export_menu import parse_jsonl

    for scenario, steps in (("memory-pressure", (3, 12, 30)), ("shared-prefix", (2, 6, 12))):
        done = await dash.backend.start_run(scenario, {"model": tiny_dir}, speed=0)
        await until_run(dash.backend, done, lambda r: r["finished"])
        await check_kv_usage_agrees(dash, parse_jsonl(await dash.backend.trace(done)), steps)


async def test_a_run_without_a_kv_cache_shows_no_kv_usage(dash: Dash, tiny_dir: str) -> None:
    """A cache-off run read 6% KV usage (#22): its engine's scratch blocks hold nothing between iterations."""
    from kvscope.frontend.export_menu import parse_jsonl
    from tests.test_dashboard import small_scenario

    done = await dash.backend.start_run(small_scenario(tiny_dir, count=3, kv_cache=False), speed=0)
    await until_run(dash.backend, done, lambda r: r["finished"])
    events = parse_jsonl(await dash.backend.trace(done))
    assert max(e["kv_usage"] for e in events if e["type"] == "metrics") > 0  # what the engine reports
    metrics = (await synthetic_column(dash, events)).views["metrics"]
    assert metrics.kpis["usage"] == "no cache" and metrics.kpis["waste"] == "–"
    assert "kv_usage" not in metrics.last_point and "kv_waste" not in metrics.last_point
    assert "tokens_per_s" in metrics.last_point


async def test_a_lesson_compared_side_by_side_shows_both_cards_and_pauses_both_sides_together(dash: Dash) -> None:
    """memory-pressure, 24 blocks vs 256, in lesson mode: it paused silently with no lesson card (#22). Each
    column has its card; when the 24-block run stops at its preemption the other is held, the line above
    the columns says which side reached it, and one continue goes on with both."""
    page = await dash.open_with_scenario("memory-pressure")
    page.compare.choose("num_blocks", 24, 256)
    dash.user.find(marker="start-compare").click()
    await until(lambda: len(dash.built) == 2)
    side = dash.last.side_by_side
    small, large = side.guides
    await until(lambda: all(g.shown == 0 and g.next.visible for g in side.guides))  # both wait on the first step
    assert all(g.feed.pacing.lesson and g.card.visible for g in side.guides)
    await dash.user.should_see("Watch the block pool fill up", marker="lesson-text")

    dash.user.find(marker="side-continue-0").click()  # one continue starts both
    await until(lambda: small.paused_at == "preempt")
    await until(lambda: 1 in side.held and large.feed.pacing.paused)
    held_at = large.feed.state.step
    assert not large.feed.state.finished and large.paused_at is None  # held for the other's moment
    await until(lambda: "reached “First preemption”" in side.hold_line.content)
    line = side.hold_line.content
    assert line.startswith(f"blocks: 24 reached “First preemption” at iteration {small.moment.step}")
    assert "blocks: 256 is held at iteration" in line and side.hold_line.visible
    await settled_feed(dash.backend, large.feed)
    assert large.feed.state.step <= held_at + 1  # an iteration under way when the pause came may end

    dash.user.find(marker="side-continue-0").click()  # continue: both go on
    await until(lambda: not side.held and not large.feed.pacing.paused)
    await until(lambda: small.paused_at == "recompute")
    await until(lambda: 1 in side.held or large.feed.state.finished)


@pytest.fixture(scope="module")
def library_url(tmp_path_factory) -> Iterator[str]:
    """A backend that keeps a run library (the shared one keeps none)."""
    manager = RunManager(library=RunLibrary(tmp_path_factory.mktemp("library")),
                         limits=ServiceLimits(allow_paths=True))
    with live_server(manager) as url:
        yield url


async def test_a_compare_page_saved_as_a_pair_reopens_side_by_side_from_the_library(
        library_url: str, tiny_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    from tests.test_dashboard import small_scenario

    async with simulated(library_url, tiny_dir) as dash:
        a = await dash.backend.start_run(small_scenario(tiny_dir, count=2), speed=0)
        b = await dash.backend.start_run(small_scenario(tiny_dir, count=2, block_size=4), speed=0)
        for run_id in (a, b):
            await until_run(dash.backend, run_id, lambda r: r["finished"])
        saved = {e["id"] for e in (await dash.backend.library())["entries"]}
        while not {a, b} <= saved:  # each is saved on its own thread as it finishes
            await asyncio.sleep(0.05)
            saved = {e["id"] for e in (await dash.backend.library())["entries"]}
        page = await dash.open(f"/?run={a}&compare={b}")
        dash.user.find(marker="save-pair").click()
        await until_pairs(dash, 1)
        [pair] = (await dash.backend.library())["pairs"]
        assert pair["runs"] == [a, b] and pair["name"] == "small: block_size=8 vs block_size=4"

        home = await dash.open("/")
        await until(lambda: home.saved is not None and home.saved.pairs)
        await dash.user.should_see(pair["name"], marker="library-pair-name")
        dash.user.find(marker="library-pair-open").click()
        await until(lambda: dash.last is not home and dash.last.side_by_side is not None)
        left, right = (f.run_id for f in dash.last.side_by_side.feeds)
        runs = {r["run_id"]: r for r in await dash.backend.runs()}
        assert runs[left]["kind"] == runs[right]["kind"] == "replay" and page is not dash.last
        await until(lambda: all(f.state is not None for f in dash.last.side_by_side.feeds))
        await until(lambda: dash.last.side_by_side.titles_now == ("block size: 8", "block size: 4"))
    assert_no_error_logs(caplog)


async def until_pairs(dash: Dash, count: int) -> None:
    for _ in range(2400):
        if len((await dash.backend.library())["pairs"]) == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the library did not list {count} pair(s)")


# ---- in a real browser ------------------------------------------------------------------------------

in_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is not installed")
# KVSCOPE_COMPARE_SHOTS=FOLDER: write the screenshots there to look at (never into the tree by default)
SHOTS = Path(os.environ.get("KVSCOPE_COMPARE_SHOTS", "/nonexistent"))


def shot(page, name: str) -> None:
    if SHOTS.is_dir():
        page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=False)


def open_pair(page, dashboard_url: str, ids: list[str]) -> None:
    page.goto(f"{dashboard_url}/?run={ids[0]}&compare={ids[1]}")
    page.locator(".kv-side-table").wait_for()


@in_chromium
def test_each_lesson_card_side_by_side_is_filled_from_its_own_run(page, backend_url, dashboard_url):
    """attention-variants, MHA against GQA: one lesson told twice, each card with its own run's bytes per
    token (the GQA figure on both cards was true of one column only). The block-cost figure is for a
    block-size pair only."""
    ids = [api(backend_url, "/api/runs", {"scenario": "attention-variants", "speed": 1, "paused": True,
                                          "lesson": True, "overrides": {"model": model}})["run_id"]
           for model in ("demo-mha", "demo")]
    open_pair(page, dashboard_url, ids)
    cards = page.locator("[data-kv=lesson-text]")
    wait_for(lambda: cards.count() == 2 and all("bytes per token" in t for t in cards.all_inner_texts()),
             "both lesson cards show their first step")
    mha, gqa = cards.all_inner_texts()
    assert "here 12,288 bytes per token" in mha and "MHA: 8 query heads; the cache keeps 8 KV heads of 32" in mha
    assert "here 3,072 bytes per token" in gqa and "GQA: 8 query heads; the cache keeps 2 KV heads of 32" in gqa
    assert not page.locator("[data-kv=block-cost]").is_visible()
    shot(page, "lesson-mha-gqa-1280" if page.viewport_size["width"] == 1280 else "lesson-mha-gqa-1600")


def block_size_pair(backend_url: str) -> list[str]:
    """Block size 16 against 1 at the same bytes (the compare form's default), finished."""
    runs = []
    for size, blocks in ((16, 64), (1, 1024)):
        run = scenario("demo", f"size-{size}", blocks, 4, 4, (16, 32), (8, 16), {"process": "burst"})
        run["engine"]["block_size"] = size
        runs.append(start(backend_url, run, speed=0, paused=False))
    wait_for(lambda: all(api(backend_url, f"/api/runs/{r}")["finished"] for r in runs), "the runs did not finish")
    return runs


@in_chromium
def test_block_size_16_against_1_draws_what_tiny_blocks_cost(page, backend_url, dashboard_url):
    open_pair(page, dashboard_url, block_size_pair(backend_url))
    figure = page.locator("[data-kv=block-cost]")
    figure.wait_for()
    bars = """(el) => getElement(el.id.slice(1)).chart.getOption().series.map((s) => s.data)"""
    wait_for(lambda: len(figure.evaluate(bars)) == 2, "the figure has a bar series per run")
    big, small = figure.evaluate(bars)
    assert all(b > 0 for b in big) and all(s > 10 * b for s, b in zip(small, big))  # entries, hashes, gathers
    assert "blocks hashed" in page.locator("[data-kv=block-cost-hashes]").inner_text()
    figure.scroll_into_view_if_needed()
    wait_at_rest(page, "the figure drawn")
    shot(page, "block-cost")


@in_chromium
def test_the_titles_and_differences_stay_in_sight_while_the_columns_scroll_in_projector_mode(
        page, backend_url, dashboard_url):
    page.set_viewport_size({"width": 1280, "height": 720})
    open_pair(page, dashboard_url, block_size_pair(backend_url))
    page.locator("[data-kv=projector]").click()
    page.wait_for_function("document.documentElement.classList.contains('kv-projector')")
    page.mouse.wheel(0, 1500)
    page.wait_for_function("window.scrollY > 1000")
    wait_at_rest(page, "scrolled down")
    header = page.locator(".q-header").bounding_box()
    boxes = [page.locator(s).bounding_box() for s in (".kv-side-title >> nth=0", ".kv-side-title >> nth=1",
                                                       ".kv-side-table")]
    for box in boxes:
        assert box["y"] >= header["y"] + header["height"] - 1 and box["y"] + box["height"] <= 720, (header, boxes)
    sticky = page.locator(".kv-compare-sticky").evaluate("(el) => [el.offsetHeight, el.scrollHeight]")
    assert sticky[0] <= 720 / 3 + 1 and sticky[1] <= sticky[0]  # compact, and both runs' rows shown whole
    shot(page, "sticky-projector-1280")
    page.set_viewport_size({"width": 1920, "height": 1080})
    wait_at_rest(page, "at 1920x1080")
    shot(page, "sticky-projector-1920")
