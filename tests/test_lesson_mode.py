"""Lesson mode under NiceGUI's simulated user: the run stops by itself at the moment a step explains."""

from __future__ import annotations

from kvscope.backend.events.moments import find_moments
from kvscope.frontend.lesson import FOCUS_CLASS, card_of, lesson_markdown, lesson_steps
from tests.server_helpers import settled_feed, until
from tests.test_dashboard import Dash, backend_url, dash, nicegui_storage, until_run  # noqa: F401 (fixtures)


async def test_lesson_mode_pauses_memory_pressure_at_its_first_preemption(dash: Dash, tiny_dir: str) -> None:
    # Unpaced: the server holds the run right after the moment's iteration, so it stops there at any speed.
    run_id = await dash.backend.start_run("memory-pressure", {"model": tiny_dir}, speed=0, paused=True, lesson=True)
    page = await dash.open(f"/?run={run_id}")
    column = page.columns[0]
    guide, feed = column.guide, column.feed
    for kind in ("allocate", "share", "copy-on-write", "free", "evict"):  # the block pool's legend names its flashes
        await dash.user.should_see(f"ring: {kind}")
    await until(lambda: guide.steps and guide.shown == 0)
    assert guide.mode.value and guide.next.visible  # a lesson run waits on its first step
    await dash.user.should_see("Watch the block pool fill up", marker="lesson-text")
    dash.user.find(marker="lesson-continue").click()

    await until(lambda: guide.paused_at == "preempt")
    await until(lambda: feed.pacing.paused)
    moment = guide.moment
    step = feed.state.step
    await settled_feed(dash.backend, feed)  # unpaced, a run that went on would be iterations further
    assert feed.state.step == step == moment.step  # at the preemption, not after it
    assert feed.state.num_preemptions >= 1
    victim = moment.request_ids[0]
    assert feed.state.requests[victim].status == "preempted"
    await dash.user.should_see("Preemption", marker="lesson-text")
    assert "First preemption" in guide.progress.text
    # the blocks it gave back are ringed, its row selected, the views to look at outlined
    events = [e.event for e in feed.log]
    freed = [e["block_id"] for e in events if e["type"] == "block_free" and e["step"] == step
             and e["request_id"] == victim]
    assert set(moment.blocks) == set(freed) and freed
    assert column.selection.request_id == victim
    for name in ("blocks", "timeline"):
        assert FOCUS_CLASS in card_of(column.views[name]).classes

    dash.user.find(marker="lesson-continue").click()
    await until(lambda: guide.paused_at == "recompute", timeout=60)
    assert guide.moment.request_ids == (victim,)
    assert FOCUS_CLASS not in card_of(column.views["blocks"]).classes  # the preemption's outline is gone
    assert FOCUS_CLASS in card_of(column.views["batch"]).classes


async def test_lesson_mode_off_lets_the_run_go_on(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run("memory-pressure", {"model": tiny_dir}, speed=0, paused=True, lesson=True)
    page = await dash.open(f"/?run={run_id}")
    guide, feed = page.columns[0].guide, page.columns[0].feed
    await until(lambda: guide.steps and guide.next.visible)
    assert guide.mode.value  # the run's lesson mode, as the server has it
    await dash.backend.control(run_id, "step", 1)  # started from the header, not the lesson's "continue"
    await until(lambda: not guide.next.visible)
    guide.mode.set_value(False)  # switches the run's lesson mode off on the server
    await until(lambda: any(e.event["type"] == "control" and e.event["action"] == "lesson" for e in feed.log))
    await guide.resume()
    await until(lambda: feed.state.finished and guide.paused_at == "finished")  # the conclusion shows anyway
    assert feed.state.num_preemptions >= 1
    assert not [e for e in feed.log if e.event["type"] == "control" and e.event["action"] == "pause"]  # never held


def test_the_drawer_lists_a_lessons_steps_with_their_moments() -> None:
    steps = lesson_steps({"lesson": [{"at": "start", "text": "a"}, {"at": "preempt", "text": "b_c"}]})
    assert lesson_markdown(steps) == "1. *Before it starts.* a\n2. *First preemption.* b\\_c"
    assert lesson_steps({"lesson": "old text"}) == [{"at": "start", "text": "old text"}]  # older traces


def test_every_moment_has_a_title() -> None:
    from kvscope.backend.events.moments import MOMENT_KINDS
    from kvscope.frontend.lesson import MOMENT_TITLES

    assert set(MOMENT_KINDS) | {"start"} == set(MOMENT_TITLES)
    assert find_moments([]) == []


async def test_compare_any_setting_of_one_scenario_side_by_side(dash: Dash) -> None:
    page = await dash.open_with_scenario("memory-pressure")
    page.compare.choose("num_blocks", 24, 256)
    dash.user.find(marker="start-compare").click()
    await until(lambda: len(dash.built) == 2)
    feeds = [c.feed for c in dash.last.columns]
    await until(lambda: all(f.state is not None and f.state.cache for f in feeds))
    assert [f.state.cache["num_blocks"] for f in feeds] == [24, 256]
    assert all(f.pacing.paused for f in feeds)
    assert feeds[0].state.config["prefix_caching"] == feeds[1].state.config["prefix_caching"]  # the rest is shared


def test_each_compare_axis_is_one_override() -> None:
    from kvscope.frontend.compare import AXES, override_of

    assert override_of(AXES["attention"], "demo-mla") == {"model": "demo-mla"}
    assert override_of(AXES["speculative"], "off") == {"engine.speculative": None}
    assert override_of(AXES["num_blocks"], 256.0) == {"engine.num_blocks": 256}
    assert override_of(AXES["arrival_rate"], 1.0) == {"generate.arrival.rate_per_step": 1.0}


async def test_a_lesson_question_takes_the_rooms_pick_and_marks_it_at_its_moment(dash: Dash, tiny_dir: str) -> None:
    """memory-pressure asks at the start which request is preempted first; the preemption answers it."""
    run_id = await dash.backend.start_run("memory-pressure", {"model": tiny_dir}, speed=0, paused=True, lesson=True)
    page = await dash.open(f"/?run={run_id}")
    guide, feed = page.columns[0].guide, page.columns[0].feed
    await until(lambda: guide.shown == 0 and guide.question.buttons)
    question = guide.question
    await dash.user.should_see("which request will give its blocks back first?", marker="question-text")
    assert list(question.buttons) == list(feed.state.requests)  # the run's own requests, all still to run
    dash.user.find(marker="question-choice-g0").click()  # the room's pick
    assert question.pick == "g0" and question.buttons["g0"].props["data-mark"] == "picked"
    dash.user.find(marker="lesson-continue").click()

    await until(lambda: guide.paused_at == "preempt")
    victim = guide.moment.request_ids[0]
    assert victim != "g0"  # the newest running request goes first, not the oldest
    assert question.buttons[victim].props["data-mark"] == "right"
    assert question.buttons["g0"].props["data-mark"] == "wrong"
    assert all(b.props["data-mark"] == "" for v, b in question.buttons.items() if v not in (victim, "g0"))
    await dash.user.should_see("was wrong.", marker="question-status")
    assert page.columns[0].selection.request_id == victim  # the moment's own highlight shows why

    dash.user.find(marker="lesson-continue").click()
    await until(lambda: guide.paused_at == "recompute", timeout=60)
    assert not question.box.visible  # answered: the next step has no question


async def test_a_run_started_from_the_page_waits_at_step_0_until_its_page_has_drawn_it(dash: Dash) -> None:
    page = await dash.open_with_scenario("continuous-batching")
    page.panel.has_lesson = lambda: False  # a scenario whose lesson never pauses (all shipped ones do)
    page.panel.speed = 0.0  # unpaced: a run that did not wait would be dozens of iterations in
    dash.user.find(marker="start-run").click()
    await until(lambda: len(dash.built) == 2)
    feed = dash.last.columns[0].feed
    await until(lambda: feed.state is not None and feed.state.finished)
    live = [e.event for e in feed.log]  # what the page's feed saw arrive, after its first snapshot
    resumed = next(i for i, e in enumerate(live) if e["type"] == "control" and e["action"] == "resume")
    assert live[resumed]["step"] == -1  # resumed by the page, before the first iteration
    assert min(e["step"] for e in live if e["type"] == "iteration") == 0
    guide = dash.last.columns[0].guide
    assert not feed.pacing.lesson
    await until(lambda: guide.paused_at == "finished")  # its conclusion, lesson mode off


async def test_the_finished_step_shows_with_lesson_mode_off_and_on_a_page_opened_after_the_end(
        dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run("chunked-prefill", {"model": tiny_dir}, speed=0, paused=True)
    page = await dash.open(f"/?run={run_id}")
    guide = page.columns[0].guide
    await until(lambda: guide.steps)
    assert not guide.mode.value
    await dash.backend.control(run_id, "resume")
    await until(lambda: guide.paused_at == "finished")
    await dash.user.should_see("never more", marker="lesson-text")  # the finished step's text
    assert FOCUS_CLASS in card_of(page.columns[0].views["metrics"]).classes
    late = await dash.open(f"/?run={run_id}")  # a second tab, after the end
    await until(lambda: late.columns[0].guide.paused_at == "finished")
    assert late.columns[0].guide.shown == len(late.columns[0].guide.steps) - 1


async def test_a_page_joining_late_draws_the_run_from_step_0(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run("chunked-prefill", {"model": tiny_dir}, speed=0, paused=True)
    await dash.backend.control(run_id, "step", 10)
    await until_run(dash.backend, run_id, lambda r: r["step"] >= 9)
    page = await dash.open(f"/?run={run_id}")
    feed = page.columns[0].feed
    await until(lambda: feed.state is not None and feed.state.step >= 9)
    history = feed.history
    assert [c.step for c in history.columns] == list(range(10))  # the whole past, not only from the join
    first = history.columns[0].cells
    assert [(c.request_id, c.kind, c.tokens) for c in first] == [("short-1", "prefill", 16), ("short-2", "prefill", 12)]
    assert sorted(history.masks) == list(range(10))  # attention masks from step 0
    assert len(history.tokens["short-1"]) == 10  # every token sampled so far, with its distribution
