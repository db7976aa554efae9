"""Every input bounded before it costs anything: each value that once killed a run's worker, planned
minutes of work or wrote bare NaN is a 400 naming its field (or, for temperatures below the floor,
greedy), and the service answers the next request as before."""

import json
import logging
import math

import pytest
import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.sampler import final_distribution
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.bus import encode_event
from kvscope.backend.events.trace import TraceError, parse_trace
from kvscope.backend.scenario import MAX_ARRIVAL_STEP, MAX_DRAWN_TOKENS, MAX_OUTPUT_TOKENS, ScenarioError, validate
from kvscope.backend.server.manager import RunManager
from tests.engine_helpers import outputs, run_engine
from tests.server_helpers import in_process



@pytest.fixture(scope="module")
def client(tiny_dir):
    manager = RunManager(default_model=tiny_dir)
    with in_process(manager) as c:
        assert_api_serves(c)  # the api run starts with the first /v1 request
        yield c


def completion(client, **body):
    return client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2, **body})


def assert_openai_400(response, param: str) -> None:
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def assert_api_serves(client) -> None:
    """The api run is alive: a normal request is answered at once."""
    response = completion(client, temperature=0)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"


# ---- sampling --------------------------------------------------------------------------------------


def test_a_temperature_below_the_floor_is_greedy_and_recorded_as_0():
    assert SamplingParams(temperature=1e-300).temperature == 0.0
    assert SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # the floor itself samples


def test_temperature_1e_300_generates_the_greedy_tokens_with_finite_logprobs(tiny):
    workload = [("r", 0, tiny.tokenizer.encode("ROMEO:\n"), 8)]
    config = EngineConfig(block_size=4, num_blocks=16)
    events: list[dict] = []
    tiny_t = run_engine(tiny, config, workload, SamplingParams(temperature=1e-300, seed=3), events=events)
    greedy = run_engine(tiny, config, workload, SamplingParams(temperature=0.0))
    assert outputs(tiny_t) == outputs(greedy)
    tokens = [e for e in events if e["type"] == "token"]
    assert len(tokens) == 8 and all(math.isfinite(e["logprob"]) and e["dist"]["temperature"] == 0.0 for e in tokens)


def test_top_k_at_or_beyond_the_vocabulary_keeps_every_token_as_top_k_0_does():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    everything = final_distribution(logits, [SamplingParams(top_k=0)], eos_ids=[])
    for top_k in (50, 51, 2**31 - 1):
        assert torch.equal(final_distribution(logits, [SamplingParams(top_k=top_k)], eos_ids=[]), everything)


def test_top_k_2_63_is_a_400_naming_it_and_the_api_run_keeps_serving(client):
    response = client.post("/api/runs/api/requests", json={"prompt": "x", "sampling": {"top_k": 2**63}})
    assert response.status_code == 400 and response.json()["field"] == "sampling.top_k"
    assert_openai_400(completion(client, top_k=2**31), "top_k")
    assert_api_serves(client)


@pytest.mark.parametrize("param, value", [("repetition_penalty", 1e-300), ("seed", 2**63), ("seed", -1),
                                          ("top_p", 0.0), ("temperature", 101.0), ("n", 17),
                                          ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
                                          ("max_tokens", 100_001), ("logprobs", 6), ("best_of", 17),
                                          ("stop_token_ids.0", [2**31])])
def test_each_sampling_field_past_its_range_is_a_400_naming_it(client, param, value):
    assert_openai_400(completion(client, **{param.split(".")[0]: value}), param)


def test_a_stop_token_id_outside_the_vocabulary_is_a_400_naming_it(client):
    assert_openai_400(completion(client, stop_token_ids=[2048]), "stop_token_ids")


@pytest.mark.parametrize("stop", ["", ["\n", ""], ["x" * 257], ["a"] * 9])
def test_an_empty_or_oversized_stop_is_a_400_naming_stop(client, stop):
    assert_openai_400(completion(client, stop=stop), "stop")
    assert_openai_400(completion(client, stop=stop, stream=True), "stop")  # before any chunk
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stop": stop})
    assert_openai_400(chat, "stop")
    sampling = client.post("/api/runs/api/requests", json={"prompt": "x", "sampling": {"stop": stop}})
    assert sampling.status_code == 400 and sampling.json()["field"].startswith("sampling.stop")


def test_echo_with_logprobs_of_a_token_id_outside_the_vocabulary_is_a_400_naming_prompt(client):
    response = completion(client, prompt=[5, 2048], max_tokens=0, echo=True, logprobs=1)
    assert_openai_400(response, "prompt")
    assert response.json()["error"]["message"] == "prompt: token id 2048 is outside the vocabulary [0, 2048)"
    assert_api_serves(client)


# ---- run controls ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1e-300, 0.009, 10_001])
def test_a_speed_outside_0_or_its_range_is_a_400_naming_value_and_the_run_keeps_serving(client, value):
    response = client.post("/api/runs/api/control", json={"action": "speed", "value": value})
    assert response.status_code == 400 and response.json()["field"] == "value"
    assert_api_serves(client)


def test_a_run_cannot_start_at_a_speed_below_the_floor(client, tiny_dir):
    response = client.post("/api/runs", json={"scenario": {"name": "s", "model": tiny_dir, "requests": [
        {"id": "a", "prompt": "x"}]}, "speed": 1e-300})
    assert response.status_code == 400 and response.json()["field"] == "speed"
    assert response.json()["error"] == "speed: speed is 0 (unpaced) or 0.01..10000 iterations per second"


@pytest.mark.parametrize("action", ["step", "seek"])
def test_step_and_seek_take_whole_numbers(client, action):
    response = client.post("/api/runs/api/control", json={"action": action, "value": 2.5})
    assert response.status_code == 400 and response.json()["error"] == f"value: {action} takes a whole number, not 2.5"


def test_speeds_at_the_ends_of_the_range_are_taken(client):
    for value in (0.01, 10_000, 0):
        response = client.post("/api/runs/api/control", json={"action": "speed", "value": value})
        assert response.status_code == 200 and response.json()["speed"] == value


# ---- scenarios: planned work, nesting -----------------------------------------------------------------


def refused(data: dict) -> ScenarioError:
    with pytest.raises(ScenarioError) as e:
        validate({"name": "bounds", **data}, "scenario")
    return e.value


def test_a_generate_section_drawing_more_prompt_tokens_than_the_limit_is_refused_naming_generate():
    error = refused({"generate": {"count": 1000, "prompt_tokens": {"min": 10_000, "max": 10_000}}})
    assert error.field == "scenario: generate"
    assert f"10000000 prompt tokens to draw from the pool" in error.reason
    assert f"at most {MAX_DRAWN_TOKENS}" in error.reason


def test_explicit_drawn_prompts_count_against_the_same_limit():
    requests = [{"id": f"r{i}", "prompt_tokens": 100_000} for i in range(2)]
    assert refused({"requests": requests + [{"id": "r2", "prompt_tokens": 60_000}]}).field == "scenario: requests"
    generate = {"count": 1, "prompt_tokens": {"min": 60_000, "max": 60_000}}
    assert refused({"requests": requests, "generate": generate}).field == "scenario: generate"


def test_more_tokens_to_generate_than_the_limit_is_refused_counting_every_sequence():
    error = refused({"requests": [{"id": "a", "prompt": "x", "max_tokens": 100_000,
                                   "sampling": {"n": 11}}]})
    assert error.field == "scenario: requests" and f"at most {MAX_OUTPUT_TOKENS}" in error.reason


def test_an_arrival_beyond_the_last_allowed_step_is_refused_naming_it():
    error = refused({"requests": [{"id": "a", "prompt": "x", "arrival_step": 1_000_000}]})
    assert error.field == "scenario: requests.0.arrival_step"
    assert error.reason == f"Input should be less than or equal to {MAX_ARRIVAL_STEP}"


def test_generated_arrivals_spread_beyond_the_last_allowed_step_are_refused():
    assert refused({"generate": {"count": 3, "arrival": {"rate_per_step": 1e-300}}}).field == \
        "scenario: generate.arrival.rate_per_step"
    error = refused({"generate": {"count": 10_000, "prompt_tokens": {"min": 1, "max": 1},
                                  "arrival": {"process": "uniform", "rate_per_step": 0.1}}})
    assert error.field == "scenario: generate" and "over ~99990 engine steps" in error.reason


def test_the_bundled_scenarios_and_the_largest_default_traffic_fit_the_limits():
    validate({"name": "big", "generate": {"count": 1953, "arrival": {"process": "poisson", "rate_per_step": 0.1}}},
             "scenario")
    validate({"name": "busy", "generate": {"count": 10_000, "prompt_tokens": {"min": 8, "max": 16}}}, "scenario")


def test_inline_yaml_nested_2000_deep_is_a_400_naming_yaml_and_logged(client, caplog):
    with caplog.at_level(logging.WARNING, logger="kvscope.backend.server.app"):
        response = client.post("/api/runs", json={"yaml": "name: deep\nrequests: " + "[" * 2000 + "]" * 2000})
    assert response.status_code == 400
    assert response.json() == {"error": "yaml: nested deeper than 32 levels at line 2", "field": "yaml"}
    assert "POST /api/runs refused: yaml: nested deeper than 32 levels" in caplog.text


def test_a_scenario_file_nested_too_deep_names_its_line_and_column(tmp_path):
    from kvscope.backend.scenario import load_scenario

    path = tmp_path / "deep.yaml"
    path.write_text("name: deep\nrequests:\n  " + "[" * 40 + "]" * 40 + "\n")
    with pytest.raises(ScenarioError) as e:
        load_scenario(str(path))
    assert str(e.value) == f"{path}:3:34: nested deeper than 32 levels"


# ---- every float in events is finite ------------------------------------------------------------------


def test_an_event_holding_nan_or_infinity_is_refused_at_encoding_naming_the_field():
    assert encode_event({"type": "token", "logprob": -0.5}) == '{"type":"token","logprob":-0.5}'
    with pytest.raises(ValueError, match=r"^token event: logprob is not a finite number$"):
        encode_event({"type": "token", "logprob": float("nan")})
    with pytest.raises(ValueError, match=r"^token event: dist\.top\[0\]\[2\] is not a finite number$"):
        encode_event({"type": "token", "logprob": 0.0, "dist": {"top": [[1, "a", float("inf"), 0.5]]}})


def test_a_trace_holding_nan_is_refused_naming_its_line():
    with pytest.raises(TraceError) as e:
        parse_trace('{"type": "header", "seq": 0, "step": -1, "t": NaN}\n', "t.jsonl")
    assert str(e.value) == "t.jsonl:1: not JSON (NaN is not a number JSON allows)"


def test_every_line_of_a_served_runs_trace_is_strict_json(client):
    completion(client, temperature=1e-300, logprobs=2, max_tokens=4)
    lines = client.get("/api/runs/api/trace").text.splitlines()

    def refuse(constant):
        raise AssertionError(f"{constant} in the trace")

    assert lines and all(json.loads(line, parse_constant=refuse) for line in lines)


def test_json_depth_counts_containers_and_stops_one_past_the_limit_without_recursion() -> None:
    """One measure for request bodies (guards.py) and grammars (structured.py): 10,000 levels would
    overflow a recursive one."""
    from kvscope.backend.engine.request import RequestError
    from kvscope.backend.server.guards import json_depth
    from kvscope.backend.server.structured import MAX_SCHEMA_DEPTH, Grammar, check_size

    assert [json_depth(v, 32) for v in ("text", [], {"a": [1, {"b": "x"}]})] == [0, 1, 3]
    deep: list = []
    node = deep
    for _ in range(10_000):
        node.append([])
        node = node[0]
    assert json_depth(deep, 32) == 33
    schema: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "array", "items": schema}
    with pytest.raises(RequestError, match=f"nested deeper than {MAX_SCHEMA_DEPTH}") as refused:
        check_size(Grammar("response_format", {"json": schema}))
    assert refused.value.field == "response_format"
    check_size(Grammar("response_format", {"json": schema["items"]["items"]}))  # 63 deep: within the bound
