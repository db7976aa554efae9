"""A lesson's exports: the moment a lesson pauses at as one slide (its view at that iteration, the moment's blocks
ringed in the colour its text names, the step's title above and text below), and the whole lesson as one
self-contained HTML handout. Drawn from a real run of a small lesson whose texts carry HTML's special characters."""

from __future__ import annotations

import base64
import json
import io
import re

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from PIL import Image

from kvscope.backend.events.bus import EventBus
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario
from kvscope.cli import main
from kvscope.frontend.export import SLIDE_SIZE, ExportError, render
from kvscope.frontend.export.figure import slide_style
from kvscope.frontend.export.handout import handout_html
from kvscope.frontend.export.lesson import draw_page, lesson_pages, moment_page
from kvscope.frontend.palette import ring_color
from tests.test_export import read_png

LESSON = [
    {"at": "start", "text": "One request asks for n = 4 samples <of one prompt> & one seed."},
    {"at": "fork", "text": "The <b>fork</b>: four sequences hold the prompt's blocks.", "views": ["timeline", "blocks"],
     "ask": {"question": "copies_on_write"}},
    {"at": "copy_on_write", "text": 'A sibling writes into the shared last block: it is "copied" (orange ring).',
     "views": ["blocks", "block_table"]},
    {"at": "finished", "text": "All four are done."},
]


def lesson_scenario(model: str) -> dict:
    return {"name": "four-ways", "description": "n = 4 <samples> & copy-on-write", "model": model, "seed": 0,
            "engine": {"block_size": 8, "num_blocks": 64, "max_num_seqs": 8, "prefix_caching": False},
            "requests": [{"id": "four", "prompt": "MENENIUS:\nWhat work's, my countrymen", "max_tokens": 12,
                          "sampling": {"temperature": 1.0, "seed": 7, "n": 4}}],
            "lesson": LESSON}


@pytest.fixture(scope="module")
def lesson_run(tiny_dir) -> list[dict]:
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    ScenarioRun(Scenario.model_validate(lesson_scenario(tiny_dir)), bus=bus).run()
    return events


def copies(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "block_copy"]


def test_this_moment_is_the_block_pool_at_its_iteration_with_its_blocks_ringed(lesson_run, tmp_path):
    cow = copies(lesson_run)
    page = moment_page(lesson_run, "copy_on_write")
    assert page.moment.step == cow[0]["step"] and page.view == "blocks"
    with slide_style():
        fig = draw_page(lesson_run, page)
    assert fig.get_suptitle() == f"four-ways · step 3 of 4 · First copy-on-write (iteration {cow[0]['step']})"
    assert fig.get_supxlabel() == LESSON[2]["text"]  # the caption: the step's text, as written
    pixels = read_png(render(lesson_run, "moment", tmp_path / "cow.png", moment="copy_on_write"))
    assert (pixels.shape[1], pixels.shape[0]) == SLIDE_SIZE
    ringed = (np.abs(pixels - np.array(to_rgb(ring_color("copy_on_write")))).max(axis=-1) < 0.01).sum()
    assert ringed > 2000 * len(page.moment.blocks)  # a ring a room sees around each block the copy concerns


def test_a_moment_drawn_as_the_first_view_its_step_names(lesson_run, tmp_path):
    page = moment_page(lesson_run, "fork")
    assert page.view == "timeline"  # named before the block pool
    with slide_style():
        assert draw_page(lesson_run, page).axes[0].get_xlabel() == "engine iteration (step)"  # the timeline's axis
    render(lesson_run, "moment", tmp_path / "fork.svg", moment="fork")
    assert "The &lt;b&gt;fork&lt;/b&gt;" in (tmp_path / "fork.svg").read_text()  # the caption, as text


def test_a_moment_the_lesson_has_no_step_for_is_an_error_that_names_its_steps(lesson_run, tmp_path):
    with pytest.raises(ExportError, match=r"no step at 'preempt' \(its steps: start, fork, copy_on_write, finished\)"):
        render(lesson_run, "moment", tmp_path / "x.png", moment="preempt")
    with pytest.raises(ExportError, match="name the lesson moment"):
        render(lesson_run, "moment", tmp_path / "x.png")


def test_the_handout_is_one_file_with_every_step_its_question_answer_and_pictures(lesson_run):
    html = handout_html(lesson_run, size=(960, 540))
    images = re.findall(r'<img src="data:image/png;base64,([^"]+)"', html)
    assert len(images) == html.count("<img") == 3  # the start has no moment to show
    for data in images:
        with Image.open(io.BytesIO(base64.b64decode(data))) as png:
            assert png.size == (960, 540)
    assert not re.search(r'(src|href)="(?!data:)', html) and "<script" not in html  # nothing to fetch
    for page in lesson_pages(lesson_run):
        assert page.title in html
    assert "One request asks for n = 4 samples &lt;of one prompt&gt; &amp; one seed." in html
    assert "The &lt;b&gt;fork&lt;/b&gt;" in html and "<b>fork</b>" not in html
    assert "it is &quot;copied&quot;" in html and "n = 4 &lt;samples&gt; &amp; copy-on-write" in html
    assert "<b>Choices:</b> 0 · 1 · 2 · 3 · 4" in html  # four live sequences at the fork
    assert f"<b>Answer:</b> {len(copies(lesson_run))}</p>" in html and len(copies(lesson_run)) == 3  # n - 1


def test_kvscope_export_handout_writes_the_html_and_a_lesson_less_trace_is_one_line(lesson_run, tmp_path, capsys):
    trace = tmp_path / "run.jsonl"
    trace.write_text("".join(f"{json.dumps(e)}\n" for e in lesson_run))
    out = tmp_path / "handout.html"
    assert main(["export", str(trace), "--handout", "--out", str(out), "--size", "640"]) == 0
    assert out.read_text().count("<img") == 3 and "the lesson as a handout" in capsys.readouterr().out
    bare = tmp_path / "bare.jsonl"
    header = {**lesson_run[0], "scenario": {**lesson_run[0]["scenario"], "lesson": []}}
    bare.write_text("".join(f"{json.dumps(e)}\n" for e in [header, *lesson_run[1:]]))
    assert main(["export", str(bare), "--handout", "--out", str(out)]) == 2
    assert "has no lesson" in capsys.readouterr().err
