"""The sampling view's what-if is exact: given a token's whole raw distribution (kept by a served run, or
recorded in the token's own event), every stage equals what the engine itself samples from, at the token's
own settings and at any other; without it the view prints only facts as facts."""

import numpy as np
import pytest
import torch

from kvscope.backend.engine.dist_rows import DistRows, RecordedRows, row_bytes
from kvscope.backend.events.bus import EventBus
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import validate
from kvscope.frontend.sampling_math import Knobs, Mask, compute_stages, knobs_of, recorded_row
from tests.test_dashboard import backend_url, dash, nicegui_storage  # noqa: F401  (the view's tests)

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo! wherefore art thou", "First Citizen:\nWe are"]
WHAT_IFS = [  # (temperature, top_k, top_p, min_p)
    (1.9, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.8, 0, 1.0, 0.1),
    (1.9, 20, 0.9, 0.02), (0.7, 3, 0.5, 0.3),
]


def run_tokens(sampling: dict, level: str = "full", rows: DistRows | None = None, max_tokens: int = 1) -> list[dict]:
    """The token events of PROMPTS on the demo model with these settings (rows: a store attached)."""
    scenario = validate({"name": "exact", "model": "demo", "seed": 0, "engine": {"events": level, "dist_top_n": 10},
                         "requests": [{"id": f"r{i}", "prompt": p, "max_tokens": max_tokens, "sampling": sampling}
                                      for i, p in enumerate(PROMPTS)]}, "test")
    bus, events = EventBus(level), []
    bus.subscribe(events.append)
    run = ScenarioRun(scenario, bus)
    run.engine.events.rows = rows
    run.run()
    return [e for e in events if e["type"] == "token"]


def row_of(rows: DistRows, token: dict) -> np.ndarray:
    data = rows.get(token["request_id"], token["seq_id"], token["position"])
    assert data is not None
    return np.frombuffer(data, dtype="<f4").astype(np.float64)


def finals(stages) -> dict[int, float]:
    return dict(zip(stages.token_ids, stages.probs["min_p"]))


@pytest.fixture(scope="module")
def at_t1() -> tuple[list[dict], DistRows]:
    rows = DistRows()
    return run_tokens({"temperature": 1.0, "seed": 1}, rows=rows, max_tokens=4), rows


def test_at_its_own_settings_the_what_if_reproduces_every_shown_final_probability(at_t1):
    tokens, rows = at_t1
    assert len(tokens) == 4 * len(PROMPTS) and len(rows) == len(tokens)
    for token in tokens:
        stages = compute_stages(token["dist"]["top"], knobs_of(token["dist"]), {0}, 2048, row_of(rows, token))
        assert stages.exact
        engine = {t[0]: t[3] for t in token["dist"]["top"]}
        assert finals(stages) == pytest.approx(engine, abs=1e-6)


@pytest.mark.parametrize("what_if", WHAT_IFS)
def test_the_what_if_of_a_t1_run_equals_the_engine_run_at_those_settings(at_t1, what_if):
    """Same prompt, same position (the first output token: the prefix is the prompt in both runs)."""
    t, k, p, m = what_if
    tokens, rows = at_t1
    theirs = {e["request_id"]: e for e in run_tokens({"temperature": t, "top_k": k, "top_p": p, "min_p": m, "seed": 2})}
    for token in tokens:
        if token["request_id"] not in theirs or token["position"] != theirs[token["request_id"]]["position"]:
            continue  # a later position: its prefix depends on what was drawn
        stages = compute_stages(token["dist"]["top"], Knobs(t, k, p, m), {0}, 2048, row_of(rows, token))
        engine = {tok[0]: tok[3] for tok in theirs[token["request_id"]]["dist"]["top"]}
        mine = finals(stages)
        assert {i: mine[i] for i in engine if i in mine} == pytest.approx({i: engine[i] for i in engine if i in mine},
                                                                          abs=1e-6)
        assert stages.tail["min_p"] == pytest.approx(1.0 - sum(mine.values()), abs=1e-6)


def test_without_the_whole_distribution_the_tail_model_is_approximate_and_says_so(at_t1):
    """The bug of #22: from the top 10 alone, T=1.9 misses where the flattened tail's mass goes."""
    tokens, rows = at_t1
    first = next(t for t in tokens if t["request_id"] == "r0")
    theirs = next(e for e in run_tokens({"temperature": 1.9, "seed": 2}) if e["request_id"] == "r0")
    engine = {tok[0]: tok[3] for tok in theirs["dist"]["top"]}
    modelled = compute_stages(first["dist"]["top"], Knobs(1.9), {0}, 2048)
    assert not modelled.exact
    errors = [abs(finals(modelled)[i] - engine[i]) for i in engine if i in finals(modelled)]
    assert max(errors) > 1e-3


def test_each_filter_reports_the_share_of_the_mass_it_removed():
    raw = np.array([0.5, 0.3, 0.1, 0.06, 0.04])
    top = [[i, f"t{i}", p, 0.0] for i, p in enumerate(raw[:2])]
    stages = compute_stages(top, Knobs(temperature=1.0, top_k=4, top_p=0.7, min_p=0.0), set(), 5, raw)
    assert stages.removed["top_k"] == pytest.approx(0.04)  # the fifth token
    assert stages.removed["top_p"] == pytest.approx(0.16 / 0.96)  # 0.5 + 0.3 reach 0.7 of 0.96
    assert stages.removed["min_p"] == 0.0
    assert stages.tail["raw"] == pytest.approx(0.2) and stages.tail["min_p"] == 0.0 and stages.tail_count == 3


def test_the_store_keeps_the_newest_rows_within_its_byte_budget():
    rows = DistRows(budget_bytes=3 * 4 * 100)  # three rows of a 100-token vocabulary
    for position in range(5):
        rows.put("r", 0, position, row_bytes(torch.full((100,), 0.01)))
    assert len(rows) == 3 and rows.bytes == 1200
    assert rows.get("r", 0, 0) is None and rows.get("r", 0, 4) is not None
    rows.put("r", 0, 9, row_bytes(torch.zeros(1000)))  # larger than the whole budget: never kept, nothing evicted
    assert len(rows) == 3 and rows.get("r", 0, 9) is None


def test_the_engine_keeps_no_row_when_events_carry_no_dist():
    rows = DistRows()
    assert run_tokens({"temperature": 1.0, "seed": 1}, level="summary", rows=rows)
    assert len(rows) == 0


def test_the_view_says_approximate_when_only_the_top_tokens_were_recorded():
    from kvscope.frontend.views.sampling import exactness_text

    top = [[1, "a", 0.5, 0.6], [2, "b", 0.2, 0.4]]
    modelled = compute_stages(top, Knobs(), {0}, 1000)
    exact = compute_stages(top, Knobs(), {0}, 1000, np.full(1000, 0.001))
    assert exactness_text(modelled, 10, False, False).startswith("approximate: only the top 10 tokens were recorded")
    assert exactness_text(exact, 10, False, False) == "exact: every stage over the whole distribution (1,000 tokens)"
    assert exactness_text(exact, 10, False, True).startswith("approximate: repetition")


# ---- rows recorded in the events (a saved run, a replay) ------------------------------------------------


def test_each_sequences_first_token_carries_its_whole_row_in_its_event_and_later_ones_do_not(at_t1):
    tokens, rows = at_t1
    firsts = {}
    for token in tokens:
        firsts.setdefault(token["request_id"], token["position"])
    for token in tokens:
        recorded = recorded_row(token["dist"])
        if token["position"] == firsts[token["request_id"]]:
            assert recorded is not None and np.array_equal(recorded, row_of(rows, token))  # the live row, bit for bit
        else:
            assert recorded is None


def test_a_run_with_no_store_attached_records_the_same_rows():
    """A headless run (kvscope run --trace) writes the rows too: its trace replays as exact."""
    tokens = run_tokens({"temperature": 1.0, "seed": 1}, max_tokens=2)
    assert [t["position"] for t in tokens if recorded_row(t["dist"]) is not None] == \
        [t["position"] for t in tokens[:len(PROMPTS)]]


@pytest.mark.parametrize("what_if", WHAT_IFS)
def test_the_what_if_from_a_recorded_row_equals_the_live_one(at_t1, what_if):
    tokens, rows = at_t1
    for token in (t for t in tokens if recorded_row(t["dist"]) is not None):
        live = compute_stages(token["dist"]["top"], Knobs(*what_if), {0}, 2048, row_of(rows, token))
        saved = compute_stages(token["dist"]["top"], Knobs(*what_if), {0}, 2048, recorded_row(token["dist"]))
        assert saved.exact and saved.probs == live.probs and saved.tail == live.tail


def test_recorded_rows_stop_at_the_budget_but_the_first_forced_token_is_kept_past_it():
    recorded = RecordedRows(budget_bytes=250)
    assert not recorded.take(first=False, forced=False, size=100)  # neither: never
    assert recorded.take(first=True, forced=False, size=100) and recorded.take(first=True, forced=False, size=100)
    assert not recorded.take(first=True, forced=False, size=100)  # 300 > 250
    assert recorded.take(first=False, forced=True, size=100)  # the lesson's mask_forced moment
    assert not recorded.take(first=False, forced=True, size=100)
    assert recorded.bytes == 300


def test_a_grammar_that_allowed_no_more_tokens_than_are_shown_is_exact_without_a_row():
    top = [[5, "{", 0.75, 1.0], [6, " {", 0.25, 0.0]]
    stages = compute_stages(top, Knobs(temperature=1.5, top_p=0.8), set(), 1000, mask=Mask(0.5, [[1, "The", 0.4]], 2))
    row = np.zeros(1000)
    row[[5, 6]] = [0.75, 0.25]
    exact = compute_stages(top, Knobs(temperature=1.5, top_p=0.8), set(), 1000, row, Mask(0.5, [[1, "The", 0.4]], 2))
    assert stages.exact and stages.probs == exact.probs and stages.tail_count == 997
    wider = compute_stages(top, Knobs(), set(), 1000, mask=Mask(0.5, [[1, "The", 0.4]], 3))  # one allowed not shown
    assert not wider.exact


def test_a_grammar_token_whose_allowed_tokens_are_all_shown_carries_no_row_and_is_exact_from_its_top():
    """structured-output's forced tokens: a few tokens allowed, all in the event's top 10."""
    scenario = validate({"name": "choice", "model": "demo", "seed": 0, "engine": {"dist_top_n": 10},
                         "requests": [{"id": "r0", "prompt": "ROMEO:\n", "max_tokens": 4, "sampling": {
                             "temperature": 0.8, "seed": 1, "structured_outputs": {"choice": ["yes", "no"]}}}]}, "test")
    bus, events, rows = EventBus("full"), [], DistRows()
    bus.subscribe(events.append)
    run = ScenarioRun(scenario, bus)
    run.engine.events.rows = rows
    run.run()
    tokens = [e for e in events if e["type"] == "token"]
    assert tokens and all(t["num_allowed"] <= 10 and recorded_row(t["dist"]) is None for t in tokens)
    for token in tokens:
        mask = Mask(token["masked_mass"], token["dist"].get("masked") or [], token["num_allowed"])
        top = compute_stages(token["dist"]["top"], Knobs(1.6, 0, 0.9), {0}, 2048, mask=mask)
        live = compute_stages(token["dist"]["top"], Knobs(1.6, 0, 0.9), {0}, 2048, row_of(rows, token), mask)
        assert top.exact and all(np.allclose(top.probs[s], live.probs[s], atol=1e-7, rtol=0) for s in live.probs)


def test_without_a_row_the_view_states_facts_and_marks_what_is_modelled():
    """"other (48 tokens)" on a 49,152-token vocabulary was the tail model's count, printed as fact (#38)."""
    from kvscope.frontend.views.sampling import axis_labels, cuts_text, exactness_text

    top = [[i, f"t{i}", p, p] for i, p in enumerate([0.5, 0.3, 0.119])]
    stages = compute_stages(top, Knobs(temperature=1.3), set(), 49_152)
    assert not stages.exact and stages.tail_count == 49_149 and stages.tail["raw"] == pytest.approx(0.081)
    assert axis_labels(stages, 0, set())[-1]["value"] == "other (49,149)"
    cuts = cuts_text(stages, Knobs(temperature=1.3))
    assert "other: 49,149 tokens holding 8.1% raw → ~" in cuts and "(modelled) final" in cuts
    assert exactness_text(stages, 3, False, False) == (
        "approximate: only the top 3 tokens were recorded; the later stages model how the other 49,149 tokens "
        "share their 8.1% (none more likely than the last shown)")


# ---- the structured-output caption (#38) ----------------------------------------------------------------


def test_under_a_grammar_the_caption_gives_the_chosen_tokens_p_as_its_bars_show_it():
    """structured-output's first token: the caption said "raw p = 0.562" (the event's logprob, after the mask)
    beside the model's bar of 0.0006. The numbers of the person request's '{"' at position 37."""
    from kvscope.frontend.views.sampling import chosen_text, prob_text

    top = [[39428, '{"', 0.562176525592804, 1.0], [2, "<|im_end|>", 0.0, 0.0], [18, "{", 0.437823, 0.0]]
    mask = Mask(0.9989, [[504, "The", 0.61], [1047, "Here", 0.2]], 2)
    stages = compute_stages(top, Knobs(temperature=0.0), {2}, 49_152, mask=mask)
    i = stages.token_ids.index(39428)
    assert stages.probs["model"][i] == pytest.approx(0.562176525592804 * (1 - 0.9989))
    assert chosen_text(stages, 39428) == (f"model p = {prob_text(stages.probs['model'][i])}, after the mask "
                                          f"{prob_text(stages.probs['masked'][i])}")
    assert chosen_text(stages, 39428) == "model p = 0.00062, after the mask 0.562"
    plain = compute_stages(top[:1], Knobs(), set(), 49_152)
    assert chosen_text(plain, 39428) == "raw p = 0.562"


# ---- the view, live and replayed (NiceGUI's simulated user against a real backend) ----------------------


async def shown_token(dash, run_id: str, request_id: str):
    """The sampling view of a page on run_id, showing request_id's first token."""
    from tests.server_helpers import until

    page = await dash.open(f"/?run={run_id}")
    column = page.columns[0]
    await until(lambda: column.feed.state is not None and request_id in column.feed.history.tokens)
    column.selection.select_request(request_id)
    column.selection.select_token(0)
    view = column.views["sampling"]
    await until(lambda: view.shown is not None and view.shown[0] == request_id and view.shown[2] == 0)
    return view


async def test_a_replayed_runs_first_token_is_exact_and_its_what_if_equals_the_live_one(dash, tiny_dir):
    """Live 83%, reopened 96% for the same what-if (#38): the replay had only the top tokens of its trace."""
    from tests.server_helpers import until
    from tests.test_dashboard import small_scenario, until_run

    live_id = await dash.backend.start_run(small_scenario(tiny_dir, count=2), speed=0)
    await until_run(dash.backend, live_id, lambda r: r["finished"])
    replay_id = await dash.backend.start_replay(await dash.backend.trace(live_id), speed=0, paused=False)
    what_if = Knobs(temperature=1.7, top_k=0, top_p=0.95, min_p=0.0)
    shown = {}
    for run_id in (live_id, replay_id):
        view = await shown_token(dash, run_id, "g0")
        view.set_knobs(what_if)
        await until(lambda: view.stages.exact and "what-if T=1.7" in view.caption.text)
        assert view.exactness.text.startswith("exact: every stage over the whole distribution")
        shown[run_id] = view.stages
    live, replayed = shown[live_id], shown[replay_id]
    for stage in live.probs:
        assert replayed.probs[stage] == pytest.approx(live.probs[stage], abs=1e-6)
        assert replayed.tail[stage] == pytest.approx(live.tail[stage], abs=1e-6)


async def test_under_a_grammar_the_caption_and_the_bars_give_the_chosen_token_the_same_p(dash):
    """structured-output at mask_forced: "raw p = 0.562" beside a bar of 0.0006 (#38)."""
    from tests.test_dashboard import until_run
    from kvscope.frontend.views.sampling import prob_text

    scenario = {"name": "grammar", "model": "demo", "seed": 0, "engine": {"num_blocks": 64, "dist_top_n": 4},
                "requests": [{"id": "verdict", "prompt": "ROMEO:\n", "max_tokens": 4,
                              "sampling": {"temperature": 0.0, "structured_outputs": {"regex": "(yes|no|[0-9]{3})"}}}]}
    run_id = await dash.backend.start_run(scenario, speed=0)
    await until_run(dash.backend, run_id, lambda r: r["finished"])
    view = await shown_token(dash, run_id, "verdict")
    token = view._selected_token()[3]
    i = view.stages.token_ids.index(token["token_id"])
    model, masked = view.stages.probs["model"][i], view.stages.probs["masked"][i]
    assert model == pytest.approx(masked * (1 - token["masked_mass"]))
    assert f"(model p = {prob_text(model)}, after the mask {prob_text(masked)})" in view.caption.text
    pushed = []
    view.push = lambda chart, option, replace_series=False: pushed.append(option)  # what goes to the chart
    view.shown = None
    view.full()
    bars = {s["id"]: s["data"] for s in pushed[-1]["series"]}
    assert view.drawn_log  # a forced token: no allowed one reaches a quarter of the model's mass
    assert bars["model"][i] == round(model, 6) and bars["masked"][i] == round(masked, 6)
