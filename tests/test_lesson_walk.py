"""A recorded walk of every scenario's lesson, as a lecturer gives it, in headless Chromium.

Each scenario is walked step by step with the lesson's "continue" button to its `finished` step, twice:
in projector mode at 1280x720, opened from the landing page (picked in the drawer, started unpaced:
lesson mode stops it at every moment anyway), and in normal mode at 1920x1080, a run started before
class opened by its address. At each step, the start's included: no page error; every view the step
names outlined (`kv-focus`); the first of them, then each other one brought by "next view", wholly in
the window beside the docked lesson card, which is whole and covers none of it; the blocks the moment
concerns ringed in the colour of what happened to them, and the other requests' blocks faded only when
the moment is about one request; a question's choices (40 px tall, 18 px type) and its status line
whole on the card. A question is answered with the first choice; in the projector walk, at the moment
that reveals it the walk steps back ("previous": the question is asked again), answers the other way
(the right choice after a wrong pick, a wrong one after a right pick) and sees the verdict flip, and a
lesson without a question steps back once from its first moment.
A screenshot of every moment goes to KVSCOPE_WALK_DIR (default: a temporary folder),
`<scenario>-<mode>-<n>-<moment>.png`, for a person to look through; the projector walk of EXPORTED also
exports its first moment (a 16:9 PNG) and, at the end, its handout from the page's export menu, as the
browser downloads them, into the same folder. With KVSCOPE_WALK_DOCS=1 the first moment of each
scenario is also written, at 1280x720, to docs/images/scenarios/<scenario>.png (docs/testing.md).

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

from kvscope.backend.events.moments import find_moments, step_views
from kvscope.backend.model.loader import missing_package
from kvscope.backend.scenario import SCENARIOS_DIR, load_scenario
from kvscope.frontend.lesson import MOMENT_TITLES
from kvscope.frontend.palette import ring_color
from tests.server_helpers import wait_for
from tests.test_browser import ROOT, WAIT_S, api, backend_url, browser, dashboard_url, page  # noqa: F401

SCENARIOS = sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml"))
DOCS_DIR = ROOT / "docs" / "images" / "scenarios"
MODES = {"projector": {"width": 1280, "height": 720},  # a projector's: what a class sees
         "normal": {"width": 1920, "height": 1080}}  # a lecturer's own screen
TITLE_KINDS = {title: kind for kind, title in MOMENT_TITLES.items()}
EXPORTED = "parallel-sampling"  # its first moment rings blocks in copy-on-write orange; it asks a question
IN_SIGHT = """(selector) => {
    const card = document.querySelector(selector);
    if (!card) return null;
    const box = card.getBoundingClientRect();
    const below = document.querySelector('.q-header').getBoundingClientRect().bottom;  // the fixed header
    return {focused: card.classList.contains('kv-focus'), top: box.top, bottom: box.bottom, left: box.left,
            right: box.right, header: below,
            whole: box.top >= below - 1 && box.bottom <= window.innerHeight + 1 && box.left >= -1
                   && box.right <= window.innerWidth + 1};
}"""
# The blocks ringed on every strip of the pool: a rank's strip rings them all, an instance's its own
RINGED = """() => [...new Set([...document.querySelectorAll('[data-kv^=block-pool] canvas')]
    .flatMap((c) => (c.dataset.ringed || '').split(' ').filter(Boolean).map(Number)))].sort((a, b) => a - b).join(' ')"""
# Each of the card's question parts (choices, status line) inside the card's visible box and the window, and
# each choice's words inside its button
ON_THE_CARD = """() => {
    const card = document.querySelector('.kv-lesson-card').getBoundingClientRect();
    const parts = [...document.querySelectorAll('.kv-lesson-card [data-kv=question-choice], '
                                                + '.kv-lesson-card [data-kv=question-status]')]
        .filter((el) => el.offsetParent !== null);
    const cut = (el) => {  // a choice's words wider or taller than the box the button gives them
        const words = el.querySelector('.q-btn__content');
        return words && (words.scrollWidth > words.clientWidth + 1 || words.scrollHeight > words.clientHeight + 1);
    };
    return parts.filter((el) => {
        const b = el.getBoundingClientRect();
        return b.top < card.top - 1 || b.bottom > Math.min(card.bottom, window.innerHeight) + 1
            || b.left < card.left - 1 || b.right > card.right + 1 || cut(el);
    }).map((el) => el.innerText);
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


def step_index(text: str) -> int:
    """'step 2 of 4 · ...' -> 1, the step's index in the lesson."""
    match = re.match(r"step (\d+) of \d+", text)
    assert match, f"not a lesson step: {text!r}"
    return int(match.group(1)) - 1


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


def start_from_the_landing_page(page, dashboard_url: str, name: str, mode: str) -> str:  # noqa: F811
    """Pick the scenario in the drawer, unpaced, and start it; its run id."""
    page.goto(dashboard_url + "/")
    if mode == "projector":
        page.locator("[data-kv=projector]").click()  # a lecture hall's type; the tab keeps it (sessionStorage)
        page.wait_for_function("() => document.documentElement.classList.contains('kv-projector')")
    choose(page, "[data-kv=scenario]", name)
    page.locator("[data-kv=scenario-about]").get_by_text("Lesson.").wait_for()
    choose(page, "[data-kv=start-speed]", "unpaced")
    page.locator("[data-kv=start-run]").click()
    page.wait_for_url(re.compile(r"\?run="))
    return re.search(r"run=([0-9a-f]+)", page.url).group(1)


def check_the_step(page, backend_url: str, run_id: str, step: dict, errors: list[str]) -> None:  # noqa: F811
    """What a class must see at a step: no page error; every view the step names outlined; the first of
    them, then each other one "next view" brings, wholly in the window beside the whole lesson card, which
    covers none of it; the question's parts whole on the card; the blocks of its moment ringed in the
    colour of what happened to them."""
    kind = step["at"]
    assert not errors, f"page errors at {kind}: {errors[:3]}"
    views = step_views(step)

    def outlined() -> bool:
        seen = [page.evaluate(IN_SIGHT, f".kv-card[data-view='{name}']") for name in views]
        return all(s is not None and s["focused"] for s in seen)

    wait_for(outlined, f"{kind}: {', '.join(views)} outlined")  # in the update with the step's text, or just after
    for i, view in enumerate(views):
        if i:
            page.locator("[data-kv=lesson-next-view]").click()
        named = f".kv-card[data-view='{view}']"
        wait_for(lambda: page.evaluate(IN_SIGHT, named)["whole"],  # a smooth scroll takes a moment
                 f"{kind}: {view} is not wholly in the window: {page.evaluate(IN_SIGHT, named)}")
        card, box = page.evaluate(IN_SIGHT, ".kv-lesson-card"), page.evaluate(IN_SIGHT, named)
        assert card["whole"], f"{kind}: the lesson card is not wholly in the window: {card}"
        assert card["left"] >= box["right"] or card["right"] <= box["left"] or card["top"] >= box["bottom"] \
            or card["bottom"] <= box["top"], f"{kind}: the lesson card covers {view}: {card} {box}"
    assert page.evaluate(IN_SIGHT, ".kv-lesson-card")["whole"], f"{kind}: the lesson card is not wholly in the window"
    assert page.evaluate(ON_THE_CARD) == [], f"{kind}: question parts off the card: {page.evaluate(ON_THE_CARD)}"
    if kind in ("start", "finished"):
        return
    moments = {m.kind: m for m in find_moments(trace_events(backend_url, run_id))}
    blocks = " ".join(str(b) for b in sorted(moments[kind].blocks))
    canvas = page.locator("[data-kv=block-pool] canvas")
    wait_for(lambda: page.evaluate(RINGED) == blocks, f"{kind}: blocks {blocks} not ringed")
    if blocks:
        assert canvas.get_attribute("data-ring-color") == ring_color(kind), f"{kind}: the ring's colour"
    # the other requests fade only for a step about one request (or whose view shows one: sampling)
    about = moments[kind].request_ids
    about_one = bool(about) and (len(about) == 1 or "sampling" in views)
    wait_for(lambda: (canvas.get_attribute("data-dimmed") == "others") == about_one,
             f"{kind}: the other requests' blocks {'do not fade' if about_one else 'fade'} ({len(about)} concerned)")


def trace_events(backend_url: str, run_id: str) -> list[dict]:  # noqa: F811
    with urllib.request.urlopen(f"{backend_url}/api/runs/{run_id}/trace", timeout=30) as r:
        return [json.loads(line) for line in r.read().decode().splitlines() if line]


CHOICES = "[data-kv=question-choice]:visible"


def asked(page) -> bool:
    """A predict-then-reveal question open on the card, no choice marked yet."""
    choices = page.locator(CHOICES)
    return choices.count() > 0 and all(not c.get_attribute("data-mark") for c in choices.all())


def pick(page, index: int) -> str:
    """The room's pick: the index-th choice (a button readable from the back of the room); its value."""
    choice = page.locator(CHOICES).nth(index)
    height, font = choice.evaluate("(el) => [el.getBoundingClientRect().height, parseFloat(getComputedStyle(el).fontSize)]")
    assert height >= 40 and font >= 18, f"a choice {height:.0f} px tall in {font:.0f} px type"
    choice.click()
    wait_for(lambda: choice.get_attribute("data-mark") == "picked", "the pick was not marked")
    return choice.get_attribute("data-choice")


def go_on(page, name: str, button: str = "lesson-continue") -> None:
    """Press continue (or previous) and wait for the card's next step."""
    before = progress(page)
    page.locator(f"[data-kv={button}]").click()
    wait_for(lambda: progress(page) not in (before, ""), f"{name}: no step after {before!r} ({button})", WAIT_S * 3)


def verdict(page) -> str | None:
    """'right' or 'wrong' once the card revealed its question's answer, else None."""
    if page.locator("[data-kv=question-choice][data-mark=right]:visible").count() == 0:
        return None
    return "right" if page.locator("[data-kv=question-status]").inner_text().endswith("was right.") else "wrong"


def screenshot(page, walk_dir: Path, name: str, index: int, kind: str) -> None:
    """The whole page (lesson card and every view) for the walk; for the docs, the window a class sees
    (the docked lesson card and the view it names), in 256 colours (a third of the bytes, no visible
    loss for flat UI)."""
    mode = "projector" if page.evaluate("kvscope.projector()") else "normal"
    page.mouse.move(page.viewport_size["width"] - 2, 2)  # no tooltip in the picture
    # a smooth scroll ("next view") still under way draws the fixed header displaced in the picture
    last = None
    for _ in range(40):  # ~2.5 s at most; a smooth scroll takes well under one
        if (y := page.evaluate("scrollY")) == last:
            break
        last = y
        page.wait_for_timeout(60)
    if index == 1 and mode == "projector" and os.environ.get("KVSCOPE_WALK_DOCS") == "1":
        DOCS_DIR.mkdir(parents=True, exist_ok=True)
        Image.open(io.BytesIO(page.screenshot())).quantize(256).save(DOCS_DIR / f"{name}.png", optimize=True)
    page.screenshot(path=str(walk_dir / f"{name}-{mode}-{index}-{kind}.png"))  # what the room sees


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SCENARIOS)
def test_walk_every_lesson_step_of(name, mode, page, backend_url, dashboard_url, walk_dir):  # noqa: F811
    scenario = load_scenario(name)
    if missing_package(scenario.model):
        pytest.skip(f"{scenario.model} is not installed ({missing_package(scenario.model)})")
    errors: list[str] = []  # the fixture fails the test on any at the end; a moment must have none already
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    page.set_viewport_size(MODES[mode])
    if mode == "projector":  # a lecturer starts it from the landing page
        run_id = start_from_the_landing_page(page, dashboard_url, name, mode)
    else:  # one started before class, opened by its address
        run_id = api(backend_url, "/api/runs", {"scenario": name, "speed": 0, "paused": True, "lesson": True})["run_id"]
        page.goto(f"{dashboard_url}/?run={run_id}")
    steps = [step.model_dump() for step in scenario.lesson]  # every lesson pauses mid-run (tests/test_scenarios.py)
    walked = walk(page, backend_url, run_id, name, steps, walk_dir, errors, step_back=mode == "projector")
    assert sorted(walked) == sorted(step["at"] for step in steps), f"{name}: walked {walked}, the lesson has {steps}"
    events = trace_events(backend_url, run_id)
    first = next(i for i, e in enumerate(events) if e["type"] in ("control", "iteration"))
    assert (events[first]["type"], events[first]["action"], events[first]["step"]) == ("control", "resume", -1), \
        "the run must wait at step 0 until its page (or the lesson's continue) starts it"


def walk(page, backend_url: str, run_id: str, name: str, steps: list[dict], walk_dir: Path,  # noqa: F811
         errors: list[str], step_back: bool) -> list[str]:
    """A lesson in lesson mode: held on its first step, then every moment with continue, to the end; with
    `step_back` (once per scenario: the card's behaviour is the same at any size), a question is answered
    both ways and a lesson without one steps back once."""
    page.locator("[data-kv=lesson-continue]").wait_for()
    assert api(backend_url, f"/api/runs/{run_id}")["step"] == -1
    assert moment_kind(progress(page)) == "start"
    check_the_step(page, backend_url, run_id, steps[0], errors)
    walked, question, stepped_back = ["start"], None, not step_back
    while walked[-1] != "finished":
        if asked(page):
            question = pick(page, 0)
        go_on(page, name)
        text = progress(page)
        kind, step = moment_kind(text), steps[step_index(text)]
        assert step["at"] == kind, f"{name}: {text!r} shows step {step}"
        check_the_step(page, backend_url, run_id, step, errors)  # waits for the outline, the scroll and the ring
        if question is not None and verdict(page) is not None:
            if step_back:
                step_back_and_answer_the_other_way(page, name, question)  # from a question's reveal
            question, stepped_back = None, True
        elif not stepped_back and kind != "finished":
            go_on(page, name, "lesson-previous")
            assert progress(page) == f"step 1 of {len(steps)} · {MOMENT_TITLES['start']}", progress(page)
            go_on(page, name)
            assert progress(page) == text, f"{name}: continue after previous did not come back to {text!r}"
            stepped_back = True
        walked.append(kind)
        screenshot(page, walk_dir, name, len(walked) - 1, kind)
        if name == "nondeterminism" and kind == "finished":  # the lesson's point, in the sampling view's strip
            strip = page.locator("[data-kv=twin-caption]")
            assert strip.is_visible() and "against alone" in strip.inner_text(), "no |Δ| strip for the last copy"
        if name == EXPORTED and page.evaluate("kvscope.projector()") and (len(walked) == 2 or kind == "finished"):
            export_from_the_menu(page, walk_dir, name, steps, kind)
    assert question is None, f"{name}: a question asked was never revealed"
    assert not page.locator("[data-kv=lesson-continue]").is_visible(), "continue at the end of the lesson"
    return walked


def export_from_the_menu(page, walk_dir: Path, name: str, steps: list[dict], kind: str) -> None:
    """What a lecturer takes to the next class: the moment the lesson is paused at as a slide, and once the run
    is finished its handout, each downloaded from the header's export menu."""
    item, out = ("Handout (HTML)", walk_dir / f"{name}-handout.html") if kind == "finished" else \
        ("This moment (PNG)", walk_dir / f"{name}-moment-{kind}.png")
    page.locator("[data-kv=export]").click()
    with page.expect_download(timeout=WAIT_S * 3000) as download:
        page.locator(".q-menu").get_by_text(item, exact=True).click()
    download.value.save_as(out)
    if kind != "finished":
        assert Image.open(out).size == (1920, 1080), f"{name}: the moment's slide is not 16:9 at 1920x1080"
        return
    handout = out.read_text(encoding="utf-8")
    pictures = sum(step["at"] != "start" for step in steps)  # the start step has no moment to draw
    assert handout.count("<img") == pictures, f"{name}: the handout has {handout.count('<img')} pictures"
    assert "<script" not in handout and "{" not in re.sub(r"<style>.*?</style>", "", handout, flags=re.S), \
        f"{name}: a script, or a placeholder left unfilled, in the handout"


def step_back_and_answer_the_other_way(page, name: str, first: str) -> None:
    """At a question's reveal: back to the step that asked it (asked again, no mark), the other answer,
    and the reveal again with the opposite verdict."""
    text, before = progress(page), verdict(page)
    right = {c.get_attribute("data-choice") for c in page.locator("[data-kv=question-choice][data-mark=right]").all()}
    back = 0
    while not asked(page):  # a step between keeps the pick, locked
        assert back < 3, f"{name}: three steps back and the question was not asked again"
        go_on(page, name, "lesson-previous")
        back += 1
    values = [c.get_attribute("data-choice") for c in page.locator(CHOICES).all()]
    assert first in values and right <= set(values), f"{name}: asked again with other choices: {values}"
    pick(page, next(i for i, v in enumerate(values) if (v in right) == (before == "wrong")))
    for _ in range(back):
        go_on(page, name)
    assert progress(page) == text, f"{name}: continue after previous did not come back to {text!r}"
    wait_for(lambda: verdict(page) == ("right" if before == "wrong" else "wrong"),
             f"{name}: the verdict did not flip from {before} ({page.locator('[data-kv=question-status]').inner_text()})")
