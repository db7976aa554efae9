"""The fuzzing harness (bench/fuzz.py), CI-sized, and the cases it found, kept as plain tests."""

import pytest

from bench.fuzz import fuzz, report
from kvscope.backend.server.guards import MAX_JSON_DEPTH
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import in_process

# 130 cases (split evenly over the route families: each gets 130 // families) take about 40 s on a quiet 2-core
# machine, the hostile classes' and the store case about 15 s each more; the time limit only
# guards a hang (a loaded machine takes longer but draws the same cases). `python -m bench.fuzz` runs longer.
CI_CASES, CI_STORE_CASES, CI_SECONDS = 130, 1, 900


HOSTILE = ["hostile: stranding grammar", "hostile: huge grammar", "hostile: nested tool history",
           "hostile: lone surrogate", "hostile: large saved run"]


def test_a_live_server_keeps_every_invariant_under_fuzzing():
    """Hostile values on every route of a live server, one case of each hostile class #35 found, and one
    tensor-parallel run with a hostile client of its store (the issue's planted pickle): no 5xx, no other
    request failed by a case, the api run serving and idle with every block free, no run failed, RSS bounded
    and back after a case's runs are closed; no code ran in a rank and its ranks are gone; every route
    family reached."""
    tally = fuzz(CI_CASES, CI_SECONDS, seed=0, class_cases=1, saved_mb=8, store_cases=CI_STORE_CASES)
    assert not tally.findings, report(tally)
    assert len(tally.routes) >= 12 + len(HOSTILE) + 1, report(tally)
    # every case the plan drew ran (the even split over the route families drops less than one per family)
    assert sum(tally.routes.values()) == tally.planned, report(tally)
    assert tally.planned > CI_CASES - len(tally.routes) + len(HOSTILE) + CI_STORE_CASES, report(tally)
    assert all(tally.routes[family] == 1 for family in HOSTILE), report(tally)
    assert tally.answers["STORE of a TP run (hostile client)"] == {"refused": 1}, report(tally)


@pytest.fixture(scope="module")
def client():
    manager = RunManager()
    with in_process(manager) as client:
        yield client


def test_a_scenario_name_too_long_for_the_file_system_is_a_404(client):
    """Found by the harness: 300 characters made the file lookup raise (ENAMETOOLONG), a 500."""
    assert client.get("/api/scenarios/" + "a" * 300).status_code == 404
    started = client.post("/api/runs", json={"scenario": "a" * 120})
    assert started.status_code == 400 and "is not a bundled scenario" in started.json()["error"]


@pytest.mark.parametrize("path", ["/api/runs", "/api/runs/api/requests", "/api/runs/api/control",
                                  "/v1/completions", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 3000])
def test_a_body_nested_past_the_depth_limit_is_a_400(client, path, depth):
    body = '{"prompt": ' + "[" * depth + "]" * depth + "}"
    answer = client.post(path, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and f"nested deeper than {MAX_JSON_DEPTH}" in answer.text
