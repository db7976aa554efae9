"""The sampling view's what-if is exact: given a token's whole raw distribution (kept by a served run),
every stage equals what the engine itself samples from, at the token's own settings and at any other."""

import numpy as np
import pytest
import torch

from kvscope.backend.engine.dist_rows import DistRows
from kvscope.backend.events.bus import EventBus
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import validate
from kvscope.frontend.sampling_math import Knobs, compute_stages, knobs_of

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
        rows.put("r", 0, position, torch.full((100,), 0.01))
    assert len(rows) == 3 and rows.bytes == 1200
    assert rows.get("r", 0, 0) is None and rows.get("r", 0, 4) is not None
    rows.put("r", 0, 9, torch.zeros(1000))  # larger than the whole budget: never kept, nothing evicted
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
