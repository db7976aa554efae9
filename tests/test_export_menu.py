"""The dashboard's export menu under NiceGUI's simulated user: a GIF renders off the event loop with a
progress bar that goes from 0 to 1, and the file reaches the browser; a lesson's moment and handout are
offered only when they can be made."""

from __future__ import annotations

import io

from PIL import Image

from kvscope.frontend.export import SLIDE_SIZE
from tests.server_helpers import until
from tests.test_dashboard import Dash, backend_url, dash, finished, nicegui_storage, small_scenario  # noqa: F401
from tests.test_handout import lesson_scenario


async def test_a_gif_export_shows_its_progress_from_0_to_1_and_hands_the_file_over(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir), speed=0)
    page = await dash.open(f"/?run={run_id}")
    await finished(page.columns[0].feed)
    menu = page.exports[0]
    assert not menu.status.visible  # nothing to report before the first export
    seen: list[float] = []
    menu.progress.on_value_change(lambda e: seen.append(e.value))
    data = await menu.export("blocks", ".gif")
    assert data is not None and menu.last == (f"kvscope-{run_id}-run.gif", len(data))
    with Image.open(io.BytesIO(data)) as gif:
        assert gif.size == SLIDE_SIZE
        frames = gif.n_frames
    assert seen[-1] == 1.0 and seen == sorted(seen)  # it only moves forward, and ends full
    assert len(seen) >= frames  # a step per frame (0 was already its value when the export began)
    assert menu.status.visible and menu.status_label.text.startswith(f"✓ kvscope-{run_id}-run.gif")


async def test_this_moment_is_offered_while_the_lesson_is_paused_at_one_and_the_handout_once_it_is_done(
        dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(lesson_scenario(tiny_dir), speed=0, paused=True, lesson=True)
    page = await dash.open(f"/?run={run_id}")
    guide, feed, menu = page.columns[0].guide, page.columns[0].feed, page.exports[0]
    await until(lambda: guide.shown == 0 and guide.next.visible)  # the start step: no moment yet
    menu.menu.set_value(True)  # opening the menu checks what can be made
    assert not menu.moment_item.enabled and not menu.handout_item.enabled
    menu.menu.set_value(False)
    await guide.resume()
    await until(lambda: guide.paused_at == "fork")
    menu.menu.set_value(True)
    assert menu.moment_item.enabled and not menu.handout_item.enabled
    data = await menu.export_moment()
    assert data is not None and menu.last == (f"kvscope-{run_id}-moment-fork.png", len(data))
    with Image.open(io.BytesIO(data)) as png:
        assert png.size == SLIDE_SIZE and "First fork" in png.info["Title"]
    while not feed.state.finished:
        await guide.resume()
        await until(lambda: guide.paused_at is not None or feed.state.finished)
    menu.refresh()
    assert menu.handout_item.enabled
    html = (await menu.export("handout", ".html")).decode()
    assert menu.last[0] == f"kvscope-{run_id}-handout.html" and html.count("<img") == 3
