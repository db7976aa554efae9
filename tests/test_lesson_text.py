"""Lesson texts filled from their own run: `{name}` placeholders, each column's own header values.

Side by side a lesson is shown twice, beside runs that differ in one setting: the MHA column's card
must say 12,288 bytes per token where the GQA one says 3,072 (#38 point 4).
"""

from __future__ import annotations

import re

import pytest

from kvscope.backend.events.bus import EventBus
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import LESSON_FIELDS, PLACEHOLDER, ScenarioError, list_scenarios, load_scenario
from kvscope.frontend.lesson_text import FIELDS, UNKNOWN, fill

# scenarios written for SmolLM2: their headers are read from the demo model, which fills the same fields
DEMO_FOR = {"smollm2"}


def header(name: str, *overrides: str) -> dict:
    """The header event of the scenario's run (it is emitted before the first iteration: no step runs)."""
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    scenario = load_scenario(name, list(overrides))
    if scenario.model in DEMO_FOR:
        scenario = load_scenario(name, [*overrides, "model=demo"])
    run = ScenarioRun(scenario, bus=bus)
    run.engine.close()  # tensor-parallel ranks are processes: end them now
    return events[0]


def test_every_lesson_field_has_a_value_and_every_value_a_field():
    assert tuple(FIELDS) == LESSON_FIELDS


def test_a_text_is_filled_with_the_runs_own_header_values():
    mha, gqa = header("attention-variants", "model=demo-mha"), header("attention-variants")
    text = ("{attention}: {kv_shape}, {kv_bytes_per_token} bytes per token, "
            "{bytes_per_block} per {block_size}-token block")
    assert fill(text, mha) == "MHA: 8 KV heads of 32, 12,288 bytes per token, 196,608 per 16-token block"
    assert fill(text, gqa) == "GQA: 2 KV heads of 32, 3,072 bytes per token, 49,152 per 16-token block"
    assert fill("prefix caching {prefix_caching}, {batching} batching", gqa) == "prefix caching on, continuous batching"


def test_a_value_the_header_does_not_hold_reads_as_a_dash():
    """An old trace's header lacks the newer fields: the text still reads, the figure says it is unknown."""
    old_trace = {"model": {}}
    filled = fill("{kv_bytes_per_token} bytes per token, {speculative}", old_trace)
    assert filled == f"{UNKNOWN} bytes per token, {UNKNOWN}"
    assert fill("no placeholder {here", {}) == "no placeholder {here"


def test_a_lesson_naming_an_unknown_placeholder_is_refused_at_load_naming_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nmodel: demo\nrequests: [{id: a, prompt: hi, max_tokens: 2}]\n"
                    "lesson:\n  - at: start\n    text: the cache holds {kv_bytes_per_tokn} bytes per token\n")
    with pytest.raises(ScenarioError, match=r"lesson\.0\.text.*unknown placeholder \{kv_bytes_per_tokn\}"):
        load_scenario(str(path))


@pytest.mark.parametrize("name", sorted(s.name for s in list_scenarios()
                                        if any(re.search(PLACEHOLDER, step.text) for step in s.lesson)))
def test_every_placeholder_of_a_scenario_fills_from_its_own_default_run(name):
    run = header(name)
    filled = [fill(step.text, run) for step in load_scenario(name).lesson]
    assert not [text for text in filled if UNKNOWN in text or re.search(PLACEHOLDER, text)], filled
