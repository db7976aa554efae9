"""Predict, then reveal: each question kind on the real run of a scenario that asks it (demo model, seed 0).

The choices are read from the run's state where the lesson asks (the start, or an earlier moment's
pause) and the answer from the events of the iteration of the moment that reveals it, as the lesson
card does.
"""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from kvscope.backend.events.moments import Moment, find_moments
from kvscope.backend.events.questions import QUESTIONS, AnswerOption, step_events
from kvscope.backend.events.state import RunState
from kvscope.backend.scenario import SCENARIOS_DIR, ScenarioError, load_scenario, validate
from kvscope.backend.server.app import create_app
from kvscope.backend.server.manager import RunManager
from tests.test_scenarios import run

ASKING = sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml")
                if any(step.ask for step in load_scenario(p.stem).lesson))


def state_at(events: list[dict], moment: Moment | None) -> RunState:
    """The state a page shows at a pause: at the start (before the first iteration), or at a moment."""
    state = RunState()
    for e in events:
        if (e["step"] >= 0) if moment is None else (e["seq"] > moment.seq):
            break
        state.apply(e)
    return state


def asked(name: str) -> tuple[str, list[AnswerOption], frozenset[str]]:
    """The scenario's (first) question: its kind, the choices offered where it is asked, the right answers."""
    events = run(name).events
    moments = {m.kind: m for m in find_moments(events)}
    step = next(s for s in load_scenario(name).lesson if s.ask)
    question = QUESTIONS[step.ask.question]
    choices = question.choices(state_at(events, moments.get(step.at) if step.at != "start" else None))
    return question.kind, choices, question.answer(step_events(events, moments[question.reveal].step))


def values(choices: list[AnswerOption]) -> list[str]:
    return [c.value for c in choices]


def test_at_least_five_scenarios_ask_a_question() -> None:
    assert len(ASKING) >= 5, ASKING


@pytest.mark.parametrize("name", ASKING)
def test_each_question_is_asked_before_its_moment_and_answered_by_one_of_its_choices(name: str) -> None:
    events = run(name).events
    moments = {m.kind: m for m in find_moments(events)}
    for step in load_scenario(name).lesson:
        if step.ask is None:
            continue
        question = QUESTIONS[step.ask.question]
        reveal = moments[question.reveal]
        ask = moments[step.at] if step.at != "start" else None
        assert ask is None or ask.step < reveal.step, f"{name}: asked at {step.at}, after its answer"
        choices = values(question.choices(state_at(events, ask)))
        answer = question.answer(step_events(events, reveal.step))
        assert len(choices) >= 2 and answer and answer <= set(choices), (name, choices, answer)


def test_memory_pressure_asks_which_request_is_preempted_first_the_newest_running_one() -> None:
    kind, choices, answer = asked("memory-pressure")
    assert kind == "preempt_victim"
    assert values(choices) == [f"g{i}" for i in range(8)]  # all waiting at the start, in arrival order
    assert choices[0].label == "g0 · 28 tokens"
    assert answer == {"g5"}  # max_num_seqs = 6: g0..g5 run, and the newest of them gives its blocks back


def test_shared_prefix_asks_how_many_blocks_the_first_hit_shares_the_prefixs_full_blocks() -> None:
    kind, choices, answer = asked("shared-prefix")
    assert kind == "shared_blocks"
    # 0; 128 // 16 prefix blocks; the first prompt (149 tokens): 9 full blocks, 10 in all
    assert values(choices) == ["0", "8", "9", "10"]
    assert answer == {"8"}


def test_speculative_draft_asks_how_many_drafts_pass_before_the_first_rejection() -> None:
    kind, choices, answer = asked("speculative-draft")
    assert kind == "accepted_before_rejection"
    assert values(choices) == ["0", "1", "2", "3"]  # k = 4 drafts, one of them rejected
    assert answer == {"2"}  # g1's first verify: two accepted, the third rejected


def test_speculative_ngram_first_rejection_is_its_first_copied_token() -> None:
    kind, choices, answer = asked("speculative-ngram")
    assert (kind, values(choices), answer) == ("accepted_before_rejection", ["0", "1", "2", "3"], {"0"})


def test_beam_search_asks_which_beam_is_pruned_first_the_original_sequence() -> None:
    kind, choices, answer = asked("beam-search")
    assert kind == "first_pruned"
    assert values(choices) == ["0", "2", "3", "4"] and choices[1].label == "seq 2"  # the beams at the fork
    assert answer == {"0"}


def test_parallel_sampling_asks_how_many_copies_the_first_write_makes_n_minus_1() -> None:
    kind, choices, answer = asked("parallel-sampling")
    assert kind == "copies_on_write"
    assert values(choices) == ["0", "1", "2", "3", "4"]  # n = 4 siblings share the block
    assert answer == {"3"}  # the last holder writes into the original in place


def test_an_iteration_without_the_moment_answers_nothing() -> None:
    assert all(q.answer([]) == frozenset() for q in QUESTIONS.values())


# ---- the schema of `ask` ---------------------------------------------------------------------------


def lesson(*steps: dict) -> dict:
    return {"name": "ask", "lesson": list(steps), "requests": [{"id": "a", "prompt": "x"}]}


def test_an_unknown_question_kind_is_refused_naming_the_field() -> None:
    with pytest.raises(ScenarioError) as e:
        validate(lesson({"at": "start", "text": "t", "ask": {"question": "who_wins"}}), "scenario")
    assert e.value.field == "scenario: lesson.0.ask.question"
    assert "'preempt_victim'" in e.value.reason


def test_a_question_revealed_before_it_is_asked_is_refused_naming_the_step() -> None:
    steps = ({"at": "preempt", "text": "the answer"}, {"at": "start", "text": "t", "ask": {"question": "preempt_victim"}})
    with pytest.raises(ScenarioError) as e:
        validate(lesson(*steps), "scenario")
    assert e.value.field == "scenario: lesson"
    assert e.value.reason == ("step 1's ask.question (preempt_victim) is revealed at the lesson's `preempt` step, "
                              "and no step after it is at preempt")
    validate(lesson(*reversed(steps)), "scenario")  # asked first, revealed after: fine


def test_the_api_refuses_a_question_without_its_reveal_as_a_400_naming_lesson(tiny_dir: str) -> None:
    manager = RunManager(default_model=tiny_dir)
    try:
        with TestClient(create_app(manager), base_url="http://127.0.0.1:8000") as client:
            body = lesson({"at": "start", "text": "t", "ask": {"question": "first_pruned"}})
            response = client.post("/api/runs", json={"scenario": body})
    finally:
        manager.stop_all()
    assert response.status_code == 400
    assert response.json()["field"] == "scenario: lesson"
    assert "ask.question (first_pruned) is revealed at the lesson's `prune` step" in response.json()["error"]
