"""The dashboard's export menu under NiceGUI's simulated user: a GIF renders off the event loop with a
progress bar that goes from 0 to 1, and the file reaches the browser."""

from __future__ import annotations

import io

from PIL import Image

from kvscope.frontend.export import SLIDE_SIZE
from tests.test_dashboard import Dash, backend_url, dash, finished, nicegui_storage, small_scenario  # noqa: F401


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
