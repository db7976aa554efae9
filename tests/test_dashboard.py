"""The dashboard under NiceGUI's simulated user: every control and view against a real backend.

The backend is the real Litestar app on a loopback port (a tiny random model: fast, and its
tokens are nonsense, which is fine: these tests check mechanics). The page is the real page
function; `user_simulation` drives it without a browser (tests/test_browser.py uses one).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nicegui import ElementFilter, app, ui
from nicegui.storage import Storage
from nicegui.testing.user import User
from nicegui.testing.user_simulation import user_simulation

from kvscope.backend.server.app import create_app
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.serve import free_port, listen, serve_in_thread
from kvscope.frontend.app import Dashboard, make_root
from kvscope.frontend.client import Backend, FeedHub, RunFeed
from kvscope.frontend.new_run import base_of
from tests.server_helpers import live_server, settled_feed, until

# Deadlines for conditions, not budgets: generous, since a loaded CI machine takes many times longer.
STEP_TIMEOUT_S = 120.0
SEE_RETRIES = int(STEP_TIMEOUT_S / 0.1)  # should_see sleeps 0.1 s between tries (NiceGUI's default: 3)


@pytest.fixture(scope="module")
def backend_url() -> str:
    with live_server(RunManager(limits=ServiceLimits(allow_paths=True))) as url:
        yield url


@pytest.fixture(scope="module", autouse=True)
def nicegui_storage() -> None:
    """Keep NiceGUI's storage files out of the working tree (what its pytest plugin does)."""
    folder = Path(tempfile.mkdtemp(prefix="kvscope-nicegui-"))
    old = Storage.path
    Storage.path = folder
    app.storage = Storage()
    yield
    Storage.path = old
    shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Dash:
    user: User
    backend: Backend
    hub: FeedHub
    built: list[Dashboard] = field(default_factory=list)

    @property
    def last(self) -> Dashboard:
        return self.built[-1]

    async def open(self, path: str) -> Dashboard:
        count = len(self.built)
        await self.user.open(path)
        await until(lambda: len(self.built) > count)
        return self.last

    async def open_with_scenario(self, name: str) -> Dashboard:
        """The landing page with `name` picked in its scenario list, once the panel holds that scenario's values."""
        page = await self.open("/")
        await until(lambda: name in page.panel.picker.options)
        page.panel.picker.set_value(name)
        base = base_of(await self.backend.scenario(name))
        await until(lambda: page.panel.base == base, f"the panel holds {name}'s own values")
        return page


@asynccontextmanager
async def simulated(backend_url: str, model: str) -> AsyncIterator[Dash]:
    """The page function under NiceGUI's simulated user, talking to the backend at `backend_url`."""
    backend = Backend(backend_url)
    hub = FeedHub(backend)
    built: list[Dashboard] = []
    async with user_simulation(make_root(backend, hub, default_model=model, on_build=built.append)) as user:
        user.should_see = functools.partial(user.should_see, retries=SEE_RETRIES)
        yield Dash(user, backend, hub, built)
        hub.close_all()
        await asyncio.sleep(0)


def assert_no_error_logs(caplog: pytest.LogCaptureFixture) -> None:
    """No ERROR record in the test's call. NiceGUI's shutdown waits 2 s for its tasks to cancel and logs an
    error when they take longer, naming those still running: on a loaded CI machine they can all finish just
    after, and a record that names none says nothing was stuck."""
    errors = [r for r in caplog.get_records("call") if r.levelno >= logging.ERROR
              and not (str(r.msg).startswith("Could not cancel") and r.args and not r.args[-1])]
    assert not errors, f"{len(errors)} error logs, the first: {[r.getMessage() for r in errors[:3]]}"


@pytest.fixture
async def dash(backend_url: str, tiny_dir: str, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Dash]:
    async with simulated(backend_url, tiny_dir) as dash:
        yield dash
    assert_no_error_logs(caplog)


def small_scenario(model: str, name: str = "small", count: int = 6, **engine) -> dict:
    return {"name": name, "model": model, "seed": 0,
            "engine": {"block_size": 8, "num_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64,
                       **engine},
            "generate": {"count": count, "arrival": {"process": "uniform", "rate_per_step": 1},
                         "prompt_tokens": {"min": 8, "max": 24}, "max_tokens": {"min": 4, "max": 10},
                         "sampling": {"temperature": 0.9, "top_p": 0.9, "seed": 1}}}


async def finished(feed: RunFeed) -> None:
    await until(lambda: feed.state is not None and feed.state.finished)


# ---- the page without a run ------------------------------------------------------------------------------


async def test_welcome_page_lists_scenarios_with_their_lesson(dash: Dash) -> None:
    page = await dash.open("/")
    await dash.user.should_see("Watch an LLM inference engine think")
    await until(lambda: "shared-prefix" in page.panel.picker.options)
    page.panel.picker.set_value("shared-prefix")
    await until(lambda: page.panel.base.get("block_size") == 16)
    await dash.user.should_see("prefix", marker="scenario-about")
    assert page.panel.form["model"] != "demo"  # the session's model (here the tiny one) stays chosen


async def test_welcome_page_lists_recent_runs_by_scenario_and_state_each_a_link(dash: Dash, tiny_dir: str) -> None:
    done = await dash.backend.start_run(small_scenario(tiny_dir, name="first-done", count=1), speed=0)
    await until_run(dash.backend, done, lambda r: r["finished"])
    replay = await dash.backend.start_replay(await dash.backend.trace(done), paused=True)
    waiting = await dash.backend.start_run(small_scenario(tiny_dir, name="then-paused", count=1), paused=True)
    page = await dash.open("/")
    with dash.user.client:
        labels = [link.text for link in ElementFilter(kind=ui.link, marker="run-link", local_scope=False)]  # page order
    for label in ("then-paused · paused · step 0", "first-done · replay · paused · step 0"):
        assert label in labels
    assert any(label.startswith("first-done · finished · step ") for label in labels)
    assert labels.index("then-paused · paused · step 0") < labels.index("first-done · replay · paused · step 0")
    dash.user.find(marker="run-link", content="then-paused").click()  # newest first, each opens its run
    await until(lambda: len(dash.built) == 2 and dash.last is not page)
    assert dash.last.columns[0].feed.run_id == waiting
    for run_id in (waiting, replay):
        await dash.backend.control(run_id, "speed", 0)
        await dash.backend.control(run_id, "resume")  # done: the module's backend holds only so many runs


async def until_run(backend: Backend, run_id: str, condition: Callable[[dict], bool]) -> None:
    """Wait until the server's description of the run meets the condition."""
    for _ in range(int(STEP_TIMEOUT_S / 0.05)):
        if any(r["run_id"] == run_id and condition(r) for r in await backend.runs()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run_id} never got there")


async def test_an_unknown_run_says_no_such_run_with_a_link_home(dash: Dash) -> None:
    page = await dash.open("/?run=nope")
    await dash.user.should_see("No such run: nope")
    assert page.columns == [] and page.controls is None  # no views spinning on "reconnecting"
    dash.user.find(marker="home-link").click()
    await until(lambda: len(dash.built) == 2)
    await dash.user.should_see("Watch an LLM inference engine think")


async def until_saved(backend: Backend, run_id: str) -> dict:
    """The library entry of a run, once the server has saved it."""
    for _ in range(int(STEP_TIMEOUT_S / 0.05)):
        entries = (await backend.library())["entries"]
        if any(e["id"] == run_id for e in entries):
            return next(e for e in entries if e["id"] == run_id)
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run_id} was never saved")


async def test_the_run_library_survives_a_restart_and_opens_renames_and_deletes_from_the_landing_page(
        tiny_dir: str, tmp_path: Path) -> None:
    from kvscope.backend.events.record import RunRecord
    from kvscope.backend.events.trace import parse_trace
    from kvscope.backend.server.library import RunLibrary

    def server():
        return serve_in_thread(create_app(RunManager(library=RunLibrary(tmp_path / "library"),
                                                     limits=ServiceLimits(allow_paths=True))))

    with server() as url:  # the lecturer prepares a run ...
        backend = Backend(url)
        done = await backend.start_run(small_scenario(tiny_dir, name="prepared"), speed=0)
        await until_saved(backend, done)
        trace = parse_trace(await backend.trace(done))
    with server() as url:  # ... and the server restarts before the class
        async with simulated(url, tiny_dir) as dash:
            page = await dash.open(f"/?run={done}")  # the old link: opened from the library, as it ended
            feed = page.columns[0].feed
            assert feed.run_id != done  # a replay of the saved trace, at its own address
            await finished(feed)
            assert feed.kind == "replay"
            expected = RunRecord.from_events(trace)
            assert feed.history.masks == expected.history.masks and any(expected.history.masks.values())
            assert {k: list(v) for k, v in feed.history.tokens.items()} == \
                {k: list(v) for k, v in expected.history.tokens.items()}

            await dash.open("/")
            await dash.user.should_see("prepared", kind=ui.label, marker="library-name")
            await dash.user.should_see(f"{trace[-1]['step']} steps", marker="library-facts")
            dash.user.find(marker="library-rename").click()
            dash.user.find(marker="library-name-input").clear().type("Week 3: paging")
            dash.user.find(marker="library-rename-save").click()
            for _ in range(int(STEP_TIMEOUT_S / 0.05)):
                if (await until_saved(dash.backend, done))["name"] == "Week 3: paging":
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the rename never reached the library")
            await dash.user.should_see("Week 3: paging", kind=ui.label, marker="library-name")

            count = len(dash.built)
            dash.user.find(marker="library-open").click()  # opens paused at its start, for the class
            await until(lambda: len(dash.built) > count)
            opened = dash.last.columns[0].feed
            await until(lambda: opened.state is not None)
            assert opened.kind == "replay" and opened.pacing.paused and opened.state.step == -1

            await dash.open("/")
            dash.user.find(marker="library-delete").click()
            dash.user.find(marker="library-delete-confirm").click()
            await dash.user.should_see("No saved runs yet", marker="library-empty")
            assert (await dash.backend.library())["entries"] == []
            await dash.open(f"/?run={done}")  # deleted: now the old link has nothing to open
            await dash.user.should_see(f"No such run: {done}")


async def test_a_feed_of_an_unknown_run_stops_at_once(dash: Dash) -> None:
    feed = RunFeed(dash.backend, "nope")
    await asyncio.wait_for(feed.run(), 5)  # the server closes with 4404: no reconnecting
    assert feed.missing and feed.state is None


async def test_a_run_lost_to_a_server_restart_ends_on_no_such_run(tiny_dir: str) -> None:
    port = free_port()
    with ExitStack() as first, ExitStack() as second:
        url = first.enter_context(serve_in_thread(create_app(RunManager(limits=ServiceLimits(allow_paths=True))), listen("127.0.0.1", port)))
        async with simulated(url, tiny_dir) as dash:
            run_id = await dash.backend.start_run(small_scenario(tiny_dir, count=1), paused=True)
            page = await dash.open(f"/?run={run_id}")
            await until(lambda: page.columns[0].feed.state is not None)
            await asyncio.to_thread(first.close)  # the server stops, and comes back without its runs
            await asyncio.to_thread(second.enter_context, serve_in_thread(create_app(RunManager(limits=ServiceLimits(allow_paths=True))), listen("127.0.0.1", port)))
            await until(lambda: len(dash.built) == 2)
            await dash.user.should_see(f"No such run: {run_id}")
            assert dash.last.columns == []


async def test_engine_form_becomes_overrides(dash: Dash, tiny_dir: str) -> None:
    page = await dash.open("/")
    await until(lambda: page.panel.base)
    form = page.panel.form
    form.update(batching="static", block_size=8, prefix_caching=False, max_num_batched_tokens=64.0)
    assert page.panel.overrides() == {"model": tiny_dir, "engine.batching": "static", "engine.block_size": 8,
                                      "engine.prefix_caching": False, "engine.max_num_batched_tokens": 64}
    dash.user.find(marker="cfg-spec_method").elements.pop().set_value("ngram")
    dash.user.find(marker="cfg-spec_num_tokens").elements.pop().set_value(3)
    dash.user.find(marker="cfg-kv_cache_dtype").elements.pop().set_value("int8")
    overrides = page.panel.overrides()
    assert overrides["engine.speculative"] == {"method": "ngram", "num_tokens": 3}
    assert overrides["engine.kv_cache_dtype"] == "int8"


# ---- a live run: every view ------------------------------------------------------------------------------


async def test_start_run_from_the_panel_and_every_view_draws_it(dash: Dash) -> None:
    page = await dash.open_with_scenario("continuous-batching")
    page.panel.speed = 0.0
    dash.user.find(marker="start-run").click()
    await until(lambda: len(dash.built) == 2)
    column = dash.last.columns[0]
    await until(lambda: column.guide.next.visible)  # a lesson: it waits on its first step
    column.guide.mode.set_value(False)  # run through, no pauses
    await until(lambda: column.feed.pacing.lesson is False)
    dash.user.find(marker="lesson-continue").click()
    await finished(column.feed)
    await until(lambda: all(v.version == column.feed.version for v in column.views.values()))
    views = column.views
    assert views["blocks"].updates and views["blocks"].changes_sent > 0
    assert all(views[name].updates for name in ("timeline", "batch", "metrics", "sampling", "attention", "kv_calc",
                                                "speculative"))
    assert views["speculative"].caption.text.startswith("No speculative decoding in this run")
    state = column.feed.state
    assert len(state.requests) == 12 and all(r.status == "finished" for r in state.requests.values())
    assert views["metrics"].kpis["done"] == "12/12"
    assert views["timeline"].rows_sent == 12
    assert "chose" in views["sampling"].caption.text
    assert views["kv_calc"].result.content.count("B per token") == 1
    await dash.user.should_see("continuous-batching")


async def test_views_follow_the_selected_request(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir, prefix_caching=False), speed=0, paused=True)
    page = await dash.open(f"/?run={run_id}")
    column = page.columns[0]
    await until(lambda: column.feed.state is not None)
    await dash.backend.control(run_id, "step", 3)  # three iterations: blocks held, tokens sampled
    await until(lambda: column.feed.state.step >= 2 and column.feed.history.tokens)
    rid = next(iter(column.feed.history.tokens))
    await until(lambda: rid in column.picker.options)
    column.picker.set_value(rid)
    assert column.selection.request_id == rid
    views = column.views
    await until(lambda: f"{rid} · iteration" in views["attention"].caption.text)
    await until(lambda: "L0" in views["block_table"].last and "seq" in views["block_table"].last)
    await until(lambda: views["sampling"].caption.text.startswith(rid))
    # the block pool's hover text and click go through the reducer's block tables
    block = column.feed.state.block_tables[min(s for s, r in column.feed.state.seq_request.items() if r == rid)][0]
    from kvscope.frontend.views.block_pool import describe_block

    assert f"block {block}" in describe_block(column.feed.state, column.feed.history, block)
    assert rid in describe_block(column.feed.state, column.feed.history, block)
    column.picker.set_value("")
    views["blocks"]._on_pick(type("E", (), {"args": {"block": block}})())
    assert column.selection.request_id == rid
    # picked in one view, it is the selection everywhere: the picker, the timeline's marked row, the pool
    assert column.picker.value == rid
    await until(lambda: {"value": rid} in [{"value": x["value"]} for x in views["timeline"].labels_sent
                                           if isinstance(x, dict)])
    await until(lambda: f"{rid}: " in views["blocks"].caption.text)  # the pool's caption follows on its next paint
    # the timeline redraws in seconds
    timeline = views["timeline"]
    drawn = timeline.updates
    timeline.set_axis("seconds")
    await until(lambda: timeline.updates > drawn)
    assert timeline.last_t is not None and timeline.step_t
    # attention: step back through the request's iterations, then the whole batch
    views["attention"].move(-1)
    assert column.selection.mask_step is not None
    dash.user.find(marker="mask-mode").click()
    views["attention"].set_batch(True)
    await until(lambda: "sequences" in views["attention"].caption.text)


async def test_sampling_what_if_knobs(dash: Dash, tiny_dir: str) -> None:
    from kvscope.frontend.sampling_math import Knobs

    run_id = await dash.backend.start_run(small_scenario(tiny_dir), speed=0, paused=True)
    page = await dash.open(f"/?run={run_id}")
    column = page.columns[0]
    await until(lambda: column.feed.state is not None)
    await dash.backend.control(run_id, "step", 2)
    await until(lambda: column.feed.history.tokens)
    view = column.views["sampling"]
    rid = next(iter(column.feed.history.tokens))
    column.selection.select_request(rid)
    column.selection.select_token(0)
    await until(lambda: view.caption.text.startswith(rid) and "T=" in view.caption.text and "what-if" not in view.caption.text)
    assert "T=0.9" in view.caption.text and view.knob_inputs["top_p"].value == 0.9
    view.set_knobs(Knobs(temperature=0.5, top_k=3, top_p=1.0, min_p=0.0))
    await until(lambda: "what-if T=0.5 top-k=3" in view.caption.text)
    await dash.user.should_see("T = 0.5", marker="knob-temperature-value")  # each slider's value, always shown
    await dash.user.should_see("top-k = 3", marker="knob-top_k-value")
    await until(lambda: view.exactness.text.startswith("exact: every stage over the whole distribution (2,048"))
    assert "top-k removed" in view.cuts.text and view.stages.exact
    token = column.feed.history.seq_output(column.feed.state, column.selection.sequence(column.feed.state))[0].event
    view.set_knobs(Knobs(temperature=0.9, top_k=0, top_p=0.9, min_p=0.0))  # the request's own settings, as a what-if
    await until(lambda: "what-if" not in view.caption.text and view.stages.exact)
    engine = {t[0]: t[3] for t in token["dist"]["top"]}
    assert dict(zip(view.stages.token_ids, view.stages.probs["min_p"])) == pytest.approx(engine, abs=1e-6)
    dash.user.find(marker="knob-reset").click()
    await until(lambda: "what-if" not in view.caption.text)
    view._on_token_click(type("E", (), {"args": 0})())
    assert column.selection.token_index == 0


# ---- speculative decoding, n > 1 and beams, quantization: the views on synthetic events ------------------


async def synthetic_column(dash: Dash, events: list[dict]):
    """A page on a feed that the test fills itself (no websocket): the header first, then the rest live."""
    from tests.test_dashboard_units import snapshot_of

    run_id = events[0]["run_id"]
    feed = RunFeed(dash.backend, run_id)
    feed.task = asyncio.get_running_loop().create_task(asyncio.Event().wait())  # stands for the websocket reader
    dash.hub.feeds[run_id] = feed
    feed.handle(snapshot_of(events[:1]))
    column = (await dash.open(f"/?run={run_id}")).columns[0]
    for e in events[1:]:
        feed.handle(e)
    await until(lambda: all(v.version == feed.version for v in column.views.values()))
    return column


async def test_headline_numbers_are_engine_time_and_a_finished_run_keeps_them(dash: Dash, tiny_dir: str) -> None:
    from kvscope.backend.events.record import RunRecord
    from kvscope.frontend.export_menu import parse_jsonl
    from tests.test_dashboard_units import paced

    done = await dash.backend.start_run(small_scenario(tiny_dir, name="timed"), speed=0)
    await until_run(dash.backend, done, lambda r: r["finished"])
    events = paced(parse_jsonl(await dash.backend.trace(done)))  # as if watched at 4 iterations a second
    column = await synthetic_column(dash, events)
    kpis, history = column.views["metrics"].kpis, RunRecord.from_events(events).history
    assert kpis["tps"] == f"{history.run_tokens_per_s():.0f}"
    ttfts = [f.ttft_s for f in history.finishes]
    assert kpis["ttft"] == f"{1000 * sum(ttfts) / len(ttfts):.0f} ms"
    # Paced, each wall-clock TTFT grew by 1 s; engine time is the iterations' own durations, which
    # lie inside the unpaced wall clock: below the paced figure whatever the machine's load.
    paced_ttft = {e["request_id"]: e["ttft_s"] for e in events if e["type"] == "request_finished"}
    assert all(f.ttft_s <= paced_ttft[f.request_id] - 1.0 for f in history.finishes)
    assert kpis["usage"] == f"{100 * history.last_busy_metrics().kv_usage:.0f}%" and kpis["usage"] != "0%"
    assert kpis["saved"] == "0"
    await dash.user.should_see("engine time", marker="kpis")


async def test_blocks_saved_by_sharing_is_the_runs_peak_as_kvscope_run_reports_it(dash: Dash, tiny_dir: str) -> None:
    """A finished shared-prefix run read 0 beside its prefix hits: the figure was its last iteration's,
    after the requests sharing blocks had left. It is the peak, as `kvscope run`'s table has it."""
    from kvscope.frontend.export_menu import parse_jsonl

    done = await dash.backend.start_run("shared-prefix", {"model": tiny_dir}, speed=0)
    await until_run(dash.backend, done, lambda r: r["finished"])
    events = parse_jsonl(await dash.backend.trace(done))
    column = await synthetic_column(dash, events)
    saved = [e["kv_blocks_saved_by_sharing"] for e in events if e["type"] == "metrics"]
    assert saved[-1] == 0 < max(saved)
    assert column.views["metrics"].kpis["saved"] == str(max(saved))


async def test_the_selected_request_shows_its_prompt_reply_and_finish_reason(dash: Dash, tiny_dir: str) -> None:
    """A lesson reads requests out: the text, not only ids and bars (#22: no prompt or finish reason shown)."""
    done = await dash.backend.start_run(small_scenario(tiny_dir, count=2), speed=0)
    await until_run(dash.backend, done, lambda r: r["finished"])
    column = (await dash.open(f"/?run={done}")).columns[0]
    await until(lambda: column.feed.state is not None and column.feed.state.finished)
    rid, view = next(iter(column.feed.state.requests.items()))
    assert not column.request_text.visible  # nothing selected
    column.selection.select_request(rid)
    await until(lambda: column.request_text.visible)
    text = column.request_text.text
    assert text.startswith(f"{rid} · finished ({view.finish_reason}) · reply, {len(view.output_token_ids)} tokens: "
                           f"{view.output_text}\nprompt, {view.prompt_len} tokens: {view.prompt_text}")
    await dash.user.should_see(f"finished ({view.finish_reason})", marker="request-text")


async def test_a_run_without_kv_cache_shows_no_cache_blocks(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir, count=2, kv_cache=False), speed=0, paused=True)
    page = await dash.open(f"/?run={run_id}")
    feed, pool = page.columns[0].feed, page.columns[0].views["blocks"]
    await until(lambda: feed.state is not None)
    await dash.backend.control(run_id, "step", 3)
    await until(lambda: feed.state.step >= 2 and pool.version == feed.version)
    assert feed.state.block_tables  # the engine still holds scratch blocks ...
    assert pool.caption.text.startswith("KV cache off") and pool.changes_sent == 0  # ... which hold no cache


async def test_speculative_view_rows_p_vs_q_and_the_formula(dash: Dash) -> None:
    from tests.test_dashboard_units import spec_story

    events = spec_story()
    column = await synthetic_column(dash, events)
    view = column.views["speculative"]
    column.selection.select_request("r0")
    await until(lambda: "kv-tok-rej" in view.rows.content)
    assert view.rows.content.count("kv-spec-row") == 2
    assert view.rows.content.index("kv-tok-bonus") < view.rows.content.index("kv-tok-rej")  # newest first
    # alpha 0.7, k 3: (1 - 0.7^4) / (1 - 0.7) = 2.53 expected; 7 tokens in 2 verifies measured
    assert "accepted 5/6 drafted = 83%" in view.caption.text and "tokens per verify 3.50" in view.caption.text
    assert "expected (1 − α^4) / (1 − α) = 2.53" in view.caption.text
    first = next(e for e in events if e["type"] == "spec_verify")
    view.pick(first["seq"], 2)
    await until(lambda: "rejected" in view.pq_caption.text)
    assert "p = 0.500, q = 0.600" in view.pq_caption.text and "min(1, p/q) = 0.83" in view.pq_caption.text
    view._on_click(type("E", (), {"args": [first["seq"], 3]})())  # the bonus position has no draft
    await until(lambda: "bonus position" in view.pq_caption.text)
    await dash.user.should_see("speculative demo-draft, k = 3", marker="run-engine")


async def test_forks_drafts_and_dtypes_in_the_other_views(dash: Dash) -> None:
    from tests.test_dashboard_units import spec_story

    column = await synthetic_column(dash, spec_story())
    views = column.views
    assert [item[7] for item in views["timeline"].branches_sent] == [1, 2]  # r1's two sequences
    assert views["timeline"].branches_sent[1][6] == 2  # seq 2 was pruned
    column.selection.select_request("r0")
    await until(lambda: "draft model for seq 0" in views["block_table"].last)
    assert "draft model 1" in views["blocks"].caption.text
    assert views["metrics"].kpis["spec"] == "83%"
    assert "weights int8 in groups of 64" in views["metrics"].memory.text
    assert "KV cache int8" in views["kv_calc"].memory.text and "B scale" in views["kv_calc"].result.content
    assert "**576 B per token**" in views["kv_calc"].result.content


async def test_a_real_quantized_run_shows_its_dtypes_and_bytes(dash: Dash, tiny_dir: str) -> None:
    scenario = small_scenario(tiny_dir, count=2, weight_quant="int8", quant_group_size=32, kv_cache_dtype="int8")
    run_id = await dash.backend.start_run(scenario, speed=0)
    column = (await dash.open(f"/?run={run_id}")).columns[0]
    await finished(column.feed)
    views = column.views
    await until(lambda: "weights int8 in groups of 32" in views["metrics"].memory.text)
    assert "KV cache int8 + a float32 scale per token and KV head: 160 B per token" in views["metrics"].memory.text
    await until(lambda: "**160 B per token**" in views["kv_calc"].result.content)  # 2 · 2 · 2 · (16 · 1 B + 4 B)
    assert views["kv_calc"].scales.value
    await until(lambda: "weights int8" in column.engine.text)  # the request bar refreshes on a timer


async def test_a_real_speculative_run_in_the_views(dash: Dash, tiny_dir: str) -> None:
    speculative = {"method": "draft", "draft_model": "demo-draft", "num_tokens": 3}
    run_id = await dash.backend.start_run(small_scenario(tiny_dir, count=2, speculative=speculative), speed=0,
                                          paused=True)
    column = (await dash.open(f"/?run={run_id}")).columns[0]
    feed, views = column.feed, column.views
    await until(lambda: feed.state is not None)
    await dash.backend.control(run_id, "step", 3)  # mid-run: the draft model holds blocks
    await until(lambda: feed.state.spec.verifies > 0 and feed.state.step >= 2)
    rid = next(iter(feed.history.verifies))
    column.selection.select_request(rid)
    view = views["speculative"]
    await until(lambda: "kv-spec-row" in view.rows.content and "p = " in view.pq_caption.text)
    assert view.rows.content.count("kv-tok-res") + view.rows.content.count("kv-tok-bonus") == \
        view.rows.content.count("kv-spec-row")  # each verify ends with the token the target added
    await until(lambda: "draft model for seq" in views["block_table"].last)
    await until(lambda: "draft model" in views["blocks"].caption.text)  # each view redraws on its own tick
    await dash.backend.control(run_id, "resume")
    await finished(feed)
    await until(lambda: "α = " in view.caption.text and view.version == feed.version)
    assert f"{feed.state.spec.verifies} verifies" in view.caption.text
    assert views["metrics"].kpis["spec"].endswith("%") and "draft demo-draft" in views["metrics"].memory.text


# ---- controls ----------------------------------------------------------------------------------------


async def test_step_play_pause_and_speed(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir), speed=2, paused=True)
    page = await dash.open(f"/?run={run_id}")
    feed = page.columns[0].feed
    await until(lambda: feed.state is not None)
    assert feed.state.step == -1
    dash.user.find(marker="step").click()
    await until(lambda: feed.state.step == 0)
    await settled_feed(dash.backend, feed)
    assert feed.state.step == 0 and page.controls.paused()  # exactly one iteration, still paused
    page.controls.speed_select.set_value(0.0)  # unpaced
    await until(lambda: page.controls.speed == 0.0)
    dash.user.find(marker="play").click()
    await finished(feed)
    runs = {r["run_id"]: r for r in await dash.backend.runs()}
    assert runs[run_id]["speed"] == 0.0 and not runs[run_id]["paused"]
    await dash.user.should_see("finished", marker="run-status")


async def test_add_a_prompt_live(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir, count=1), speed=0, paused=True)
    page = await dash.open(f"/?run={run_id}")
    feed = page.columns[0].feed
    await until(lambda: feed.state is not None)
    dash.user.find(marker="prompt").type("ROMEO:\\nHark")
    dash.user.find(marker="prompt-send").click()
    await until(lambda: "live-1" in feed.state.requests)
    assert feed.state.requests["live-1"].prompt_text == "ROMEO:\nHark"
    await until(lambda: "live-1" in page.columns[0].picker.options)


async def test_replay_an_uploaded_trace_and_seek(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir), speed=0)
    page = await dash.open(f"/?run={run_id}")
    await finished(page.columns[0].feed)
    trace = await dash.backend.trace(run_id)
    upload = dash.user.find(marker="trace-upload").elements.pop()
    await upload.handle_uploads([ui.upload.SmallFileUpload("run.jsonl", "application/x-ndjson", trace.encode())])
    await until(lambda: len(dash.built) == 2)
    replay = dash.last
    assert not replay.columns[0].prompt_row.visible  # a replay takes no new requests: hidden from the start
    feed = replay.columns[0].feed
    await until(lambda: feed.state is not None and feed.kind == "replay")
    assert replay.controls.seek.visible and replay.controls.num_steps > 3
    await dash.user.should_not_see(marker="prompt")
    replay.controls.seek.set_value(3)
    await replay.controls._on_seek()
    await until(lambda: feed.state.step == 2)  # the state just before iteration 3
    replay.controls.speed_select.set_value(0.0)
    await until(lambda: replay.controls.speed == 0.0)
    dash.user.find(marker="play").click()
    await finished(feed)


def record_view(record) -> tuple[dict, dict]:
    """What every view is drawn from: the state (less the server's word on the end) and the whole past."""
    from dataclasses import asdict

    snap = {k: v for k, v in record.state.snapshot().items() if k != "finished"}
    return snap, asdict(record.history)


def short_scenario_trace_checks(events: list[dict], name: str) -> None:
    types = [e["type"] for e in events]
    if name == "memory-pressure":
        assert types.count("preempt") >= 2
    else:
        assert "seq_fork" in types and any(e["type"] == "seq_end" and e["reason"] == "pruned" for e in events)


@pytest.mark.parametrize("name", ["memory-pressure", "beam-search"])
async def test_seeking_a_replay_anywhere_shows_what_a_fresh_replay_stopped_there_shows(
        dash: Dash, tiny_dir: str, name: str, tmp_path: Path) -> None:
    from kvscope.backend.events.record import RunRecord
    from kvscope.frontend.export import render
    from kvscope.frontend.export_menu import parse_jsonl
    from kvscope.frontend.views.chunks import Chunks
    from kvscope.frontend.views.timeline import column_items, merge_runs

    short = {"memory-pressure": {"generate.max_tokens.max": 30}, "beam-search": {}}
    done = await dash.backend.start_run(name, {"model": tiny_dir, **short[name]}, speed=0)
    await until_run(dash.backend, done, lambda r: r["finished"])
    trace = await dash.backend.trace(done)
    events = parse_jsonl(trace)
    short_scenario_trace_checks(events, name)
    replay = await dash.backend.start_replay(trace, paused=True)
    page = await dash.open(f"/?run={replay}")
    feed, controls, timeline = page.columns[0].feed, page.controls, page.columns[0].views["timeline"]
    await until(lambda: feed.state is not None and controls.num_steps > 3)
    end = controls.num_steps - 1
    for target in (end // 2, end * 3 // 4, end // 3, 0, end, end // 2 + 1, 1):  # forward, back, start, end
        epoch = feed.epoch
        controls.seek.set_value(target)
        await controls._on_seek()
        await until(lambda: feed.epoch > epoch and timeline.epoch == feed.epoch)
        fresh = RunRecord.from_events([e for e in events if e["step"] < target])
        assert record_view(feed.record) == record_view(fresh), f"seek to {target}"
        drawn = sorted(item for _, data in timeline.chunks.all() for item in data)
        chunks, last_t = Chunks("tl-", build=merge_runs), None
        for col in fresh.history.columns:
            for item in column_items(col, last_t, fresh.history.rows, None):
                chunks.add(col.step, item)
            last_t = col.t
        assert drawn == sorted(item for _, data in chunks.all() for item in data), f"timeline at {target}"
    assert await dash.backend.trace(replay) == trace  # the trace handed out is the one given
    png = await page.exports[0].export("timeline", ".png")
    assert png == render(events, "timeline", tmp_path / "cli.png").read_bytes()  # what `kvscope export` draws


async def test_a_replay_page_has_no_prompt_box_even_before_its_snapshot(dash: Dash, tiny_dir: str) -> None:
    done = await dash.backend.start_run(small_scenario(tiny_dir, count=1), speed=0)
    await until_run(dash.backend, done, lambda r: r["finished"])
    replay = await dash.backend.start_replay(await dash.backend.trace(done), speed=0)
    feed = dash.hub.feeds[replay] = RunFeed(dash.backend, replay)  # a feed still waiting for its snapshot
    feed.task = asyncio.get_running_loop().create_task(asyncio.Event().wait())
    page = await dash.open(f"/?run={replay}")
    column = page.columns[0]
    assert column.feed is feed and not column.prompt_row.visible  # the run list said "replay"
    column.prompt_row.set_visibility(True)
    await until(lambda: not column.prompt_row.visible)  # the column's refresh, with no snapshot yet, hides it again
    assert column.feed is feed and feed.state is None
    feed.task.cancel()


async def test_side_by_side_static_vs_continuous(dash: Dash) -> None:
    page = await dash.open_with_scenario("continuous-batching")
    page.compare.choose("batching", "static", "continuous")
    dash.user.find(marker="start-compare").click()
    await until(lambda: len(dash.built) == 2)
    compare = dash.last
    feeds = [c.feed for c in compare.columns]
    assert len(feeds) == 2
    await until(lambda: all(f.state is not None for f in feeds))
    assert [f.state.config["batching"] for f in feeds] == ["static", "continuous"]
    for feed in feeds:  # its lesson pauses at moments (a request queued...): here the runs go to the end
        await dash.backend.control(feed.run_id, "lesson", 0)
    await until(lambda: not any(f.pacing.lesson for f in feeds))
    await compare.controls.step()
    await until(lambda: all(f.state.step >= 0 for f in feeds))  # past 0 too: a drawn run may have started by itself
    compare.controls.speed_select.set_value(0.0)
    await until(lambda: compare.controls.speed == 0.0)
    for feed in feeds:  # each, not the header's toggle: a run its page has drawn may have started by itself
        await dash.backend.control(feed.run_id, "resume")
    for feed in feeds:
        await finished(feed)
    static, continuous = (f.state.step for f in feeds)
    assert static > continuous  # the lesson: static batching needs more iterations
    assert len({c.views["timeline"].chart.id for c in compare.columns}) == 2
    side = compare.side_by_side
    await until(lambda: side.titles[1].content == "batching: continuous")
    assert side.titles[0].content == "batching: static"  # from the headers' diff, not from the form
    iterations = [f'<td class="kv-differs">{n + 1}</td>' for n in (static, continuous)]
    await until(lambda: all(cell in side.differences.content for cell in iterations))
    assert "prefill tokens computed" in side.differences.content  # a column if they differ, else the same-line
    # both columns' per-iteration charts end at the longer run's last iteration
    assert set(side.sent.values()) == {(-0.5, static + 0.5)} and len(side.sent) == 6


# ---- the hardware what-if ---------------------------------------------------------------------------------


async def test_the_hardware_picker_reprices_the_timeline_the_roofline_and_the_latencies(
        dash: Dash, tiny_dir: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import platform

    from kvscope.backend.perf.machine_cache import CACHE_VERSION, write_cache
    from kvscope.backend.perf.hardware import DATASHEET

    run_id = await dash.backend.start_run(small_scenario(tiny_dir, count=3), speed=0)
    page = await dash.open(f"/?run={run_id}")
    column = page.columns[0]
    timeline, roofline, metrics = (column.views[name] for name in ("timeline", "roofline", "metrics"))
    await finished(column.feed)
    timeline.set_axis("modelled")
    await until(lambda: timeline.clock is not None and len(timeline.step_t) == column.feed.state.step + 1)
    assert timeline.axis_name() == f"seconds modelled on {DATASHEET['h100'].label}"
    await until(lambda: roofline.roof_sent and "iterations · model sizes" in roofline.caption.text)
    on_h100, roofs_h100 = dict(timeline.step_t), roofline.roof_sent
    assert "model sizes: the trace header" in roofline.caption.text  # the header carries the model's config
    # a point per iteration, once the view has drawn the last one (its feed may be a delta behind the run's)
    await until(lambda: sorted(p[2] for chunks in roofline.chunks.values() for _, data in chunks.all() for p in data)
                == sorted(column.hardware.modelled().steps))
    assert metrics.modelled.text.startswith(f"modelled on {DATASHEET['h100'].label}: mean TTFT ")
    dash.user.find(marker="hardware-picker").elements.pop().set_value("l4")  # memory-bound steps: slower on an L4
    await until(lambda: timeline.step_t and timeline.step_t != on_h100)
    assert all(timeline.step_t[s] > on_h100[s] for s in on_h100)
    assert "modelled on l4" in timeline.axis_toggle.options.values()
    await until(lambda: roofline.roof_sent != roofs_h100)
    assert roofline.roof_sent[0][-1][1] == DATASHEET["l4"].fp32_flops  # the tiny model computes in fp32
    assert roofline.caption.text.startswith(DATASHEET["l4"].label)
    assert metrics.modelled.text.startswith(f"modelled on {DATASHEET['l4'].label}")
    dash.user.find(marker="hardware-tp").elements.pop().set_value(8)  # 4 heads cannot be split 8 ways
    await until(lambda: "cannot model this run" in timeline.axis_name())
    assert "attention heads" in metrics.modelled.text and timeline.clock is None
    # this machine, measured before (the cache): no 4 s wait, and one device, so tp 1
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    write_cache({"version": CACHE_VERSION, "host": platform.node(), "device": "test CPU", "fp32_flops": 5e10,
                 "bf16_flops": 5e10, "mem_bandwidth": 2e10, "gemv_efficiency": 0.5, "gemm_efficiency": 0.3,
                 "memory_bytes": 1e10, "measured_at": "today"})
    dash.user.find(marker="hardware-tp").elements.pop().set_value(1)
    dash.user.find(marker="hardware-picker").elements.pop().set_value("this-machine")
    await until(lambda: timeline.axis_name() == "seconds modelled on test CPU (measured)")
    await until(lambda: roofline.roof_sent[0] and roofline.roof_sent[0][-1][1] == 5e10)
    await until(lambda: "weights stream at 10.0 GB/s over one token, 6.0 over several" in roofline.caption.text)
    # It ran here: the points are the steps as measured, and what they took beyond the roofs is the fixed cost
    assert re.search(r"fixed cost [\d.,]+ ms per decode step \(measured: the engine's clock; the step took",
                     roofline.caption.text), roofline.caption.text
    drawn = [p for chunks in roofline.chunks.values() for _, data in chunks.all() for p in data]
    durations = {c.step: c.duration_s for c in column.feed.history.columns}
    assert drawn and all(p[8] and p[3] == round(durations[p[2]] * 1e6, 2) for p in drawn)  # measured µs
    line, fixed = roofline.roof_sent
    assert fixed and all(y < min(2e10 * x, 5e10) for x, y in fixed)  # the dashed line: under both roofs


# ---- explanations, calculator, export -------------------------------------------------------------------


async def test_every_view_explains_itself(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir, count=1), speed=0, paused=True)
    await dash.open(f"/?run={run_id}")
    for title in ("Block pool (KV cache)", "Timeline: requests over iterations", "Batch composition per iteration",
                  "Metrics over time", "Block table of the selected request", "Attention mask",
                  "Sampling: from logits to the chosen token", "Roofline on the chosen hardware",
                  "KV memory calculator"):
        await dash.user.should_see(title)
        dash.user.find(marker=f"help-{title}").click()
    # every view's legend, under its title (tests/test_legends.py checks they name every colour)
    from kvscope.frontend.views import attention, batch, block_pool, block_table, sampling, timeline
    with dash.user.client:
        legends = [h.content for h in ElementFilter(kind=ui.html, local_scope=False) if "kv-legend" in h.content]
    for items in (timeline.legend_items(), batch.legend_items(), block_pool.LEGEND, block_pool.ring_legend(),
                  block_table.LEGEND, attention.LEGEND, sampling.LEGEND):
        assert any(all(label in shown for _, label in items) for shown in legends), items
    await dash.user.should_see("paged attention")
    await dash.user.should_see("block diagonal")
    await dash.user.should_see("2 · L · N_kv · D_h · bytes")
    await dash.user.should_see("arithmetic intensity")


async def test_kv_calculator_uses_the_header_and_answers_what_if(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir, count=1), speed=0, paused=True)
    page = await dash.open(f"/?run={run_id}")
    view = page.columns[0].views["kv_calc"]
    await until(lambda: view.model_text.content)
    # the tiny model: 2 layers, 2 KV heads of 16 dims, fp32
    assert "2 x L x N_kv x D_h x bytes" in view.model_text.content and "512 B per token" in view.model_text.content
    assert view.result.content.startswith("2 · 2 · 2 · 16 · 4 B = **512 B per token**")
    view.variant.set_value("mqa")
    assert "**256 B per token**" in view.result.content
    view.variant.set_value("mla")
    view.fields["latent"].set_value(24)
    assert view.result.content.startswith("2 · 24 · 4 B = **192 B per token**")
    dash.user.find(marker="kv-load-model").click()
    assert "**512 B per token**" in view.result.content


async def test_export_png_perfetto_and_trace(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir), speed=0)
    page = await dash.open(f"/?run={run_id}")
    await finished(page.columns[0].feed)
    menu = page.exports[0]
    png = await menu.export("timeline", ".png")
    assert png is not None and png.startswith(b"\x89PNG")
    svg = await menu.export("blocks", ".svg")
    assert svg is not None and b"<svg" in svg[:500]
    perfetto = await menu.export("timeline", ".json")
    assert perfetto is not None and b"traceEvents" in perfetto
    await menu.download_trace()
    assert menu.last == (f"kvscope-{run_id}.jsonl", len(await dash.backend.trace(run_id)))


# ---- multi-sequence runs, a run without KV cache, one request followed everywhere ---------------------------


async def real_column(dash: Dash, tiny_dir: str, scenario: str, **overrides):
    """A finished real run of a shipped scenario on the tiny model, fed to a page event by event."""
    from kvscope.frontend.export_menu import parse_jsonl

    done = await dash.backend.start_run(scenario, {"model": tiny_dir, **overrides}, speed=0)
    await until_run(dash.backend, done, lambda r: r["finished"])
    events = parse_jsonl(await dash.backend.trace(done))
    return await synthetic_column(dash, events), events


async def test_beams_read_as_rows_with_totals_and_every_view_follows_one_beam(dash: Dash, tiny_dir: str) -> None:
    column, events = await real_column(dash, tiny_dir, "beam-search")
    views, state = column.views, column.feed.state
    sampling, attention, table = views["sampling"], views["attention"], views["block_table"]
    column.selection.select_request("beams")
    seqs = state.requests["beams"].seq_ids
    await until(lambda: sampling.strip.content.count("kv-seq-line") == len(seqs))
    pruned = [e for e in events if e["type"] == "seq_end" and e["reason"] == "pruned"]
    assert sampling.strip.content.count("kv-seq-pruned") == len(pruned)
    assert f"pruned at step {pruned[0]['step']}" in sampling.strip.content and "score " in sampling.strip.content
    assert sampling.seq_picker.visible and set(sampling.seq_picker.options) == set(seqs)
    best = state.requests["beams"].outputs[0]
    await until(lambda: f"beams · seq {best['seq_id']} ·" in sampling.caption.text)  # the best beam by default
    for seq in (pruned[0]["seq_id"], best["seq_id"]):
        sampling.seq_picker.set_value(seq)  # the picker, as a user would
        assert column.selection.seq_id == seq
        await until(lambda: f"beams · seq {seq} ·" in sampling.caption.text)
        assert "Σ log p" in sampling.caption.text and "nothing is sampled" in sampling.caption.text
        assert "no token with a distribution" not in sampling.caption.text
        await until(lambda: f"beams · seq {seq} · iteration" in attention.caption.text)
        step, masks = attention._selected()
        assert [m["seq_id"] for m in masks] == [seq]
        assert f"· {masks[0]['key_len']} keys" in attention.caption.text
    sampling._on_token_click(type("E", (), {"args": [0, pruned[0]["seq_id"]]})())  # a token of another row
    assert (column.selection.seq_id, column.selection.token_index) == (pruned[0]["seq_id"], 0)
    await until(lambda: f"beams · seq {pruned[0]['seq_id']} · position" in sampling.caption.text)
    assert 'kv-tok kv-tok-selected" data-s="%d" data-i="0"' % pruned[0]["seq_id"] in sampling.strip.content
    await until(lambda: "holds no blocks" in table.last)  # finished: every block given back


async def test_siblings_each_have_a_row_and_their_own_distributions(dash: Dash, tiny_dir: str) -> None:
    column, _ = await real_column(dash, tiny_dir, "parallel-sampling")
    sampling = column.views["sampling"]
    column.selection.select_request("four-ways")
    await until(lambda: sampling.strip.content.count("kv-seq-line") == 4)
    outputs = column.feed.state.requests["four-ways"].outputs
    for out in outputs:
        column.selection.select_sequence(out["seq_id"])
        await until(lambda: f"four-ways · seq {out['seq_id']} · position" in sampling.caption.text)
        assert "chose" in sampling.caption.text  # a sampled token: its distribution, stage by stage
        assert f"Σ log p {out['cumulative_logprob']:.2f}" in sampling.strip.content


async def test_a_beam_mid_run_holds_its_parents_tokens_in_the_block_table(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run("beam-search", {"model": tiny_dir}, speed=0, paused=True)
    column = (await dash.open(f"/?run={run_id}")).columns[0]
    feed, table = column.feed, column.views["block_table"]
    await until(lambda: feed.state is not None)
    await dash.backend.control(run_id, "step", 2)  # the beams have forked: the new ones have not run yet
    await until(lambda: feed.state.step >= 1 and table.version == feed.version)
    column.selection.select_request("beams")
    await until(lambda: "tokens in" in table.last)
    assert " · 0 tokens in" not in table.last
    assert table.last.count("kv-seq-head") == len([s for s in feed.state.block_tables
                                                   if feed.state.seq_request[s] == "beams"])
    await dash.backend.control(run_id, "resume")
    await finished(feed)


async def test_without_kv_cache_the_views_say_recompute(dash: Dash, tiny_dir: str) -> None:
    from kvscope.backend.events.history import KINDS
    from kvscope.frontend.views.batch import PHASE

    column, _ = await real_column(dash, tiny_dir, "kv-cache-off", **{"engine.kv_cache": False})
    timeline, batch = column.views["timeline"], column.views["batch"]
    cells = [item for _, data in timeline.chunks.all() for item in data]
    assert KINDS.index("recompute") in {c[3] for c in cells} and KINDS.index("decode") not in {c[3] for c in cells}
    segments = [item for _, data in batch.segments.all() for item in data]
    assert PHASE["recompute"] in {s[5] for s in segments} and PHASE["decode"] not in {s[5] for s in segments}
    assert "recompute (no KV cache" in timeline.legend.content and ">decode<" not in timeline.legend.content
    assert "recompute: whole context" in batch.legend.content and "decode tokens" not in batch.legend.content


async def test_the_selected_request_stands_out_in_the_batch_chart_and_the_block_pool(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir, prefix_caching=False), speed=0, paused=True)
    column = (await dash.open(f"/?run={run_id}")).columns[0]
    feed, pool, batch = column.feed, column.views["blocks"], column.views["batch"]
    await until(lambda: feed.state is not None)
    await dash.backend.control(run_id, "step", 4)
    await until(lambda: feed.state.step >= 3 and pool.version == feed.version and batch.version == feed.version)
    assert pool.picked_sent == []
    rid = next(r for r in feed.state.running)
    column.picker.set_value(rid)
    held = sorted({b for s, r in feed.state.seq_request.items() if r == rid for b in feed.state.block_tables.get(s, ())})
    await until(lambda: pool.picked_sent == held and held)
    # the batch chart redraws on its own tick: its segments existed (unmarked) before the pick
    await until(lambda: {item[8] for _, data in batch.segments.all() for item in data if item[6] == rid} == {1})
    segments = [item for _, data in batch.segments.all() for item in data]
    assert {item[8] for item in segments if item[6] == rid} == {1}  # outlined
    assert {item[8] for item in segments if item[6] != rid} <= {2}  # dimmed
    column.picker.set_value("")  # follow running: nothing singled out
    await until(lambda: pool.picked_sent == [])
    await until(lambda: {item[8] for _, data in batch.segments.all() for item in data} == {0})


async def test_the_api_runs_headline_is_what_metrics_reports(dash: Dash, backend_url: str) -> None:
    """The API's run shows each request's own times (the engine's clock), the numbers GET /metrics
    observes: the page's means are the scraped histograms' sum over count, its KV usage the gauge."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=backend_url, timeout=60) as client:
        for max_tokens in (6, 9, 4):
            body = {"model": "demo", "prompt": "ROMEO:\nBut soft, what light", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            (await client.post("/v1/completions", json=body)).raise_for_status()
        scraped = {s.name: s.value for f in text_string_to_metric_families((await client.get("/metrics")).text)
                   for s in f.samples if s.labels.get("model_name") == "demo"}
    column = (await dash.open("/?run=api")).columns[0]
    metrics = column.views["metrics"]
    finished = int(scraped["vllm:e2e_request_latency_seconds_count"])
    await until(lambda: metrics.kpis["done"] == f"{finished}/{finished}")

    def mean_ms(name: str) -> float:
        return 1000 * scraped[f"{name}_sum"] / scraped[f"{name}_count"]

    assert metrics.kpis["ttft"] == f"{mean_ms('vllm:time_to_first_token_seconds'):.0f} ms"
    assert metrics.kpis["tpot"] == f"{mean_ms('vllm:request_time_per_output_token_seconds'):.1f} ms"
    assert metrics.kpis["queue"] == f"{mean_ms('vllm:request_queue_time_seconds'):.0f} ms"
    assert metrics.kpis["usage"] == f"{100 * scraped['vllm:kv_cache_usage_perc']:.0f}%"
    await dash.user.should_see("mean TTFT", marker="kpis")
    await dash.user.should_not_see("mean TTFT (engine)", marker="kpis")
