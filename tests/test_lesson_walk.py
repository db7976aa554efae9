"""A recorded walk of every scenario's lesson, as a lecturer gives it, in headless Chromium.

Each scenario is opened from the landing page (picked in the drawer, started unpaced: lesson mode
stops it at every moment anyway) and walked step by step with the lesson's "continue" button to its
`finished` step, in projector mode at 1280x720. At each moment: no page error, the view the step names
outlined (`kv-focus`) and, with the docked lesson card, wholly in the window, and the blocks the moment
concerns ringed in the block pool; a question on the card answered with its first choice, and marked
at the moment that reveals it. A screenshot of
every moment goes to KVSCOPE_WALK_DIR (default: a temporary folder), `<scenario>-<n>-<moment>.png`,
for a person to look through; with KVSCOPE_WALK_DOCS=1 the first moment of each scenario is also
written, at 1280x720, to docs/images/scenarios/<scenario>.png (docs/testing.md).

The servers, the browser and the page-error check are tests/test_browser.py's fixtures.
"""

from __future__ import annotations

import io
import json
import os
import re
import urllib.request
from pathlib import Path

import pytest
from PIL import Image
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from kvscope.backend.events.moments import VIEWS, find_moments
from kvscope.backend.model.loader import missing_package
from kvscope.backend.scenario import SCENARIOS_DIR, load_scenario
from kvscope.frontend.lesson import MOMENT_TITLES
from tests.server_helpers import wait_for
from tests.test_browser import ROOT, WAIT_S, api, backend_url, browser, dashboard_url, page  # noqa: F401

SCENARIOS = sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml"))
DOCS_DIR = ROOT / "docs" / "images" / "scenarios"
VIEWPORT = {"width": 1280, "height": 720}  # a projector's: what a class sees
TITLE_KINDS = {title: kind for kind, title in MOMENT_TITLES.items()}
IN_SIGHT = """(selector) => {
    const card = document.querySelector(selector);
    if (!card) return null;
    const box = card.getBoundingClientRect();
    const below = document.querySelector('.q-header').getBoundingClientRect().bottom;  // the fixed header
    return {focused: card.classList.contains('kv-focus'), top: box.top, bottom: box.bottom, header: below,
            whole: box.top >= below - 1 && box.bottom <= window.innerHeight + 1 && box.left >= -1
                   && box.right <= window.innerWidth + 1};
}"""


@pytest.fixture(scope="module")
def walk_dir(tmp_path_factory) -> Path:
    folder = Path(os.environ["KVSCOPE_WALK_DIR"]) if os.environ.get("KVSCOPE_WALK_DIR") else \
        tmp_path_factory.mktemp("walk")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def progress(page) -> str:
    return page.locator("[data-kv=lesson-progress]").inner_text()


def moment_kind(text: str) -> str:
    """'step 2 of 4 · First prefill chunk (iteration 4)' -> 'prefill_chunk'."""
    match = re.search(r"· (.+?)(?: \(iteration \d+\))?$", text)
    assert match and match.group(1) in TITLE_KINDS, f"not a lesson step: {text!r}"
    return TITLE_KINDS[match.group(1)]


def choose(page, select: str, option: str, tries: int = 4) -> None:
    """Open a select and click one of its options. A click that lands while the page is still wiring the
    select up (a loaded machine) opens no menu: open it again, a bounded number of times."""
    for attempt in range(tries):
        page.locator(select).click()
        try:
            page.get_by_role("option", name=option, exact=True).click(timeout=15_000)
            return
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise
            page.keyboard.press("Escape")  # a half-open menu closes before the next try


def start_from_the_landing_page(page, dashboard_url: str, name: str) -> str:  # noqa: F811
    """Pick the scenario in the drawer, unpaced, and start it; its run id."""
    page.goto(dashboard_url + "/")
    page.locator("[data-kv=projector]").click()  # a lecture hall's type; the tab keeps it (sessionStorage)
    page.wait_for_function("() => document.documentElement.classList.contains('kv-projector')")
    choose(page, "[data-kv=scenario]", name)
    page.locator("[data-kv=scenario-about]").get_by_text("Lesson.").wait_for()
    choose(page, "[data-kv=start-speed]", "unpaced")
    page.locator("[data-kv=start-run]").click()
    page.wait_for_url(re.compile(r"\?run="))
    return re.search(r"run=([0-9a-f]+)", page.url).group(1)


def check_the_moment(page, backend_url: str, run_id: str, kind: str, errors: list[str]) -> None:  # noqa: F811
    """What a class must see at a moment: no page error, the views the step names outlined, the first
    of them and the lesson card both wholly in the window (projector mode), and the blocks it concerns ringed."""
    assert not errors, f"page errors at {kind}: {errors[:3]}"
    views = VIEWS[kind]

    def outlined() -> bool:
        seen = [page.evaluate(IN_SIGHT, f".kv-card[data-view='{name}']") for name in views]
        return all(s is not None and s["focused"] for s in seen)

    wait_for(outlined, f"{kind}: {', '.join(views)} outlined")  # in the update with the moment's text, or just after
    # projector mode's promise (docs/dashboard.md): the lesson card and the view it names, both whole
    named = f".kv-card[data-view='{views[0]}']"
    wait_for(lambda: page.evaluate(IN_SIGHT, named)["whole"],  # a smooth scroll takes a moment
             f"{kind}: {views[0]} is not wholly in the window: {page.evaluate(IN_SIGHT, named)}")
    assert page.evaluate(IN_SIGHT, ".kv-lesson-card")["whole"], f"{kind}: the lesson card is not wholly in the window"
    if kind == "finished":
        return
    moments = {m.kind: m for m in find_moments(trace_events(backend_url, run_id))}
    blocks = " ".join(str(b) for b in moments[kind].blocks)
    canvas = page.locator("[data-kv=block-pool] canvas")
    wait_for(lambda: (canvas.get_attribute("data-ringed") or "") == blocks,
             f"{kind}: blocks {blocks} not ringed")


def trace_events(backend_url: str, run_id: str) -> list[dict]:  # noqa: F811
    with urllib.request.urlopen(f"{backend_url}/api/runs/{run_id}/trace", timeout=30) as r:
        return [json.loads(line) for line in r.read().decode().splitlines() if line]


CHOICES = "[data-kv=question-choice]:visible"


def answer_the_moment(page) -> bool:
    """What the class does at a moment before it goes on: a predict-then-reveal question open on the card
    gets the room's pick (its first choice), then continue. Whether a question was answered."""
    choices = page.locator(CHOICES)
    asked = choices.count() > 0 and all(not c.get_attribute("data-mark") for c in choices.all())
    if asked:
        choices.first.click()
        wait_for(lambda: page.locator(CHOICES).first.get_attribute("data-mark") == "picked",
                 "the pick was not marked")
    page.locator("[data-kv=lesson-continue]").click()
    return asked


def revealed(page) -> bool:
    """The card marks a question's right answer (the moment that answers it has come)."""
    return page.locator("[data-kv=question-choice][data-mark=right]:visible").count() > 0


def screenshot(page, walk_dir: Path, name: str, index: int, kind: str) -> None:
    """The whole page (lesson card and every view) for the walk; for the docs, the window a class sees
    (the docked lesson card and the view it names), in 256 colours (a third of the bytes, no visible
    loss for flat UI)."""
    page.mouse.move(VIEWPORT["width"] - 2, 2)  # no tooltip in the picture
    if index == 1 and os.environ.get("KVSCOPE_WALK_DOCS") == "1":
        DOCS_DIR.mkdir(parents=True, exist_ok=True)
        Image.open(io.BytesIO(page.screenshot())).quantize(256).save(DOCS_DIR / f"{name}.png", optimize=True)
    page.evaluate("window.scrollTo(0, 0)")  # the fixed header at the top of the long picture
    page.screenshot(path=str(walk_dir / f"{name}-{index}-{kind}.png"), full_page=True)


@pytest.mark.parametrize("name", SCENARIOS)
def test_walk_every_lesson_step_of(name, page, backend_url, dashboard_url, walk_dir):  # noqa: F811
    scenario = load_scenario(name)
    if missing_package(scenario.model):
        pytest.skip(f"{scenario.model} is not installed ({missing_package(scenario.model)})")
    errors: list[str] = []  # the fixture fails the test on any at the end; a moment must have none already
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    page.set_viewport_size(VIEWPORT)
    run_id = start_from_the_landing_page(page, dashboard_url, name)
    steps = [step.at for step in scenario.lesson]  # every lesson pauses mid-run (tests/test_scenarios.py)
    walked = walk(page, backend_url, run_id, name, walk_dir, errors)
    assert sorted(walked) == sorted(steps), f"{name}: walked {walked}, the lesson has {steps}"
    events = trace_events(backend_url, run_id)
    first = next(i for i, e in enumerate(events) if e["type"] in ("control", "iteration"))
    assert (events[first]["type"], events[first]["action"], events[first]["step"]) == ("control", "resume", -1), \
        "the run must wait at step 0 until its page (or the lesson's continue) starts it"


def walk(page, backend_url: str, run_id: str, name: str, walk_dir: Path, errors: list[str]) -> list[str]:  # noqa: F811
    """A lesson in lesson mode: held on its first step, then every moment with continue, to the end."""
    page.locator("[data-kv=lesson-continue]").wait_for()
    assert api(backend_url, f"/api/runs/{run_id}")["step"] == -1
    assert moment_kind(progress(page)) == "start"
    walked, questions = ["start"], 0
    while walked[-1] != "finished":
        before = progress(page)
        questions += answer_the_moment(page)
        wait_for(lambda: progress(page) != before and page.locator("[data-kv=lesson-continue]").is_visible(),
                 f"{name}: no step after {walked[-1]} (at {before!r})", WAIT_S * 3)
        kind = moment_kind(progress(page))
        check_the_moment(page, backend_url, run_id, kind, errors)  # waits for the outline, the scroll and the ring
        if questions and revealed(page):
            questions -= 1
        walked.append(kind)
        screenshot(page, walk_dir, name, len(walked) - 1, kind)
    assert questions == 0, f"{name}: a question asked was never revealed"
    return walked
