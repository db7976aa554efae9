"""A request can only fail itself (#35): a grammar that strands its row, on every route that takes one, ends
that request alone: a 400 in OpenAI's shape naming the field the client sent, or the error as a stream's
last chunk (`response.failed` on the Responses API), and `abort` with the reason in the trace. Another
request streaming at the same time finishes normally, the run stays up, and nothing in the trace is NaN.

Before the fix the engine's NaN reached the event encoder, the run failed, and every request in flight got
409 run_failed; then, with the engine's row failures, the API answered an aborted request as if it were
an answer (`finish_reason: "abort"` and the text so far).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from kvscope.backend.server.grammar_answers import answer_problem
from tests.server_helpers import client, manager, model_name, served_model, url, wait_for  # noqa: F401

STRANDS = {"type": "string", "pattern": "[^\\s\\S]"}  # the string's opening quote, then nothing is allowed
STRANDS_ARGS = {"type": "object", "properties": {"a": STRANDS}, "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": STRANDS_ARGS}}]
USER = [{"role": "user", "content": "Say something."}]
MODEL = served_model()
PACE = 40  # iterations a second while a test runs: the request beside the case is still streaming when it lands

# field sent -> (the chat body's extra fields, the param the error names)
STRANDING = {
    "response_format": ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": STRANDS}}},
                        "response_format"),
    "structured_outputs": ({"structured_outputs": {"json": STRANDS}}, "structured_outputs"),
    "guided_json": ({"guided_json": STRANDS}, "guided_json"),
    "tool_choice-named": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
                          "tool_choice"),
    "tool_choice-required": ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
}
# refused at admission: xgrammar tells that no token is allowed at the start
NOTHING_AT_START = {
    "guided_regex": ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    "guided_grammar": ({"guided_grammar": 'root ::= root "a"'}, "guided_grammar"),  # left recursion, no base case
    "structured_outputs-regex": ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs"),
}


@pytest.fixture
def http(url) -> Iterator[httpx.Client]:  # noqa: F811
    with httpx.Client(base_url=url, timeout=120) as h:
        h.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})  # the api run exists
        assert h.post("/api/runs/api/control", json={"action": "speed", "value": PACE}).status_code == 200
        yield h
        h.post("/api/runs/api/control", json={"action": "speed", "value": 0})
        run = next(r for r in h.get("/api/runs").json() if r["run_id"] == "api")
        assert not run["failed"], "the case failed the run everyone shares"
        for line in h.get("/api/runs/api/trace").text.splitlines():  # strict JSON: no NaN reached an event
            json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the trace: {line[:200]}"))


@contextmanager
def beside_another(client: openai.OpenAI) -> Iterator[None]:  # noqa: F811
    """A completion streaming while the block runs: afterwards it must have streamed all its tokens."""
    stream = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=32, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)  # it runs
    yield
    rest = list(chunks)
    finishes = [c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"], "the request beside the case did not finish normally"


def error_of(answer: httpx.Response) -> dict:
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]


def trace_end(http: httpx.Client, request_id: str) -> dict:
    """The request's request_finished event (a stranded one is aborted with its reason)."""
    return wait_for(lambda: next((e for e in map(json.loads, http.get("/api/runs/api/trace").text.splitlines())
                                  if e["type"] == "request_finished" and e["request_id"] == request_id), None),
                    f"request {request_id} finished in the trace")


@pytest.mark.parametrize("case", list(STRANDING))
def test_a_grammar_that_strands_its_row_is_a_400_naming_the_field_and_fails_nothing_else(http, client, case):
    fields, param = STRANDING[case]
    with beside_another(client):
        error = error_of(http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 64, **fields}))
    assert error["param"] == param and error["code"] == "grammar_allows_no_token"
    assert error["type"] == "invalid_request_error" and "allows no token" in error["message"]
    assert error["message"].startswith(f"{param}: ")
    served = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2)
    assert served.choices[0].finish_reason  # the run serves


@pytest.mark.parametrize("case", list(NOTHING_AT_START))
def test_a_grammar_that_allows_nothing_at_its_start_is_refused_before_it_runs(http, client, case):
    fields, param = NOTHING_AT_START[case]
    with beside_another(client):
        error = error_of(http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 64, **fields}))
    assert error["param"] == param and "allows no token at its start" in error["message"]


def sse_data(answer: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in answer.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("case", ["response_format", "tool_choice-required"])
def test_a_stranded_stream_ends_with_the_error_as_its_last_chunk_never_a_stop(http, client, case):
    fields, param = STRANDING[case]
    with beside_another(client):
        answer = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 64, "stream": True,
                                                          **fields})
    assert answer.status_code == 200
    *chunks, error, done = sse_data(answer)
    assert done == "[DONE]" and json.loads(error)["error"]["param"] == param
    assert json.loads(error)["error"]["code"] == "grammar_allows_no_token"
    finishes = [c["finish_reason"] for chunk in chunks for c in json.loads(chunk)["choices"]]
    assert set(finishes) == {None}  # no choice was reported finished, least of all "stop"


def test_the_official_client_raises_bad_request_for_a_stranded_answer_and_reads_the_stream_error(http, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": STRANDS}})
    assert refused.value.body["param"] == "response_format"
    with pytest.raises(openai.APIError, match="allows no token"):
        for _ in client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, stream=True,
                                                extra_body={"guided_json": STRANDS}):
            pass


def test_the_responses_api_answers_a_stranded_grammar_with_a_400_or_response_failed(http, client):
    body = {"input": "Say something.", "max_output_tokens": 64,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": STRANDS}}}
    with beside_another(client):
        error = error_of(http.post("/v1/responses", json=body))
    assert error["param"] == "text.format" and error["code"] == "grammar_allows_no_token"
    with beside_another(client):
        answer = http.post("/v1/responses", json={**body, "stream": True})
    events = [json.loads(d) for d in sse_data(answer)]
    assert events[-1]["type"] == "response.failed" and not any(e["type"] == "response.completed" for e in events)
    failure = events[-1]["response"]["error"]
    assert failure["code"] == "grammar_allows_no_token" and failure["message"].startswith("text.format: ")


def test_a_live_request_with_a_stranding_grammar_is_aborted_alone_with_its_reason(http, client):
    """POST /api/runs/api/requests: the request is accepted, then ends `abort` with the reason in the trace."""
    with beside_another(client):
        added = http.post("/api/runs/api/requests", json={"prompt": "ROMEO:", "max_tokens": 8, "sampling": {
            "temperature": 0, "structured_outputs": {"json": STRANDS}}})
        assert added.status_code == 201, added.text
        end = trace_end(http, added.json()["request_id"])
    assert end["finish_reason"] == "abort" and "allows no token" in end["reason"]
    refused = http.post("/api/runs/api/requests", json={"prompt": "ROMEO:", "max_tokens": 8, "sampling": {
        "structured_outputs": {"regex": "[^\\s\\S]"}}})
    assert refused.status_code == 400 and refused.json()["field"] == "sampling.structured_outputs.regex"


@pytest.mark.parametrize("outputs, text, problem", [
    ({"json": {"type": "number", "minimum": 1e-300, "maximum": 2e-300}}, "", "not JSON"),
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}, '{"a": "x"}',
     "does not follow the schema at a"),
    ({"json": {"type": "array", "uniqueItems": True}}, '[{"a": 1}, {"a": 1}]', "repeated"),
    ({"json_object": True}, "[1]", "not an object"),
    ({"choice": ["yes", "no"]}, "maybe", "not one of the choices"),
    ({"json": {"type": "object"}}, '{"a": 1}', None),
    ({"json": {"type": "string", "pattern": "^(a+)+$"}}, '"' + "a" * 40 + '!"', None),  # left to the grammar
    ({"regex": "[0-9]+"}, "x", None),  # the grammar is the only definition of a regex's answers
])
def test_an_answer_is_checked_against_what_the_client_asked_within_bounds(outputs, text, problem):
    found = answer_problem(outputs, text)
    assert (found is None) if problem is None else (problem in found)


def test_an_answer_the_schema_refuses_is_a_400_never_an_empty_stop(http, client):
    """xgrammar compiles [1e-300, 2e-300] to a grammar whose only answer is the empty one: it was `""` with
    finish_reason stop. Refused at admission now (an empty answer is never JSON), and checked at the end."""
    schema = {"type": "number", "minimum": 1e-300, "maximum": 2e-300}
    with beside_another(client):
        error = error_of(http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 8,
                                                                   "guided_json": schema}))
    assert error["param"] == "guided_json" and "empty" in error["message"]


def test_an_engine_error_names_the_grammars_field_or_none_for_scores_that_are_not_numbers():
    """Any per-row failure of sampling fails its request alone: a stranded grammar names the field it came
    from; scores that are not numbers (no field of the client's to blame) are `sampling_failed`."""
    from kvscope.backend.engine.request_output import Finished
    from kvscope.backend.engine.sample_step import GRAMMAR_STRANDED, NOT_A_NUMBER
    from kvscope.backend.server.generation import own_failure
    from kvscope.backend.server.structured import Grammar

    def finished(error: str | None) -> Finished:
        return Finished("r", "abort", ({"seq_id": 0, "output_token_ids": [], "output_text": "",
                                        "finish_reason": "abort"},), error=error)

    grammar = Grammar("guided_json", {"json": STRANDS})
    stranded = own_failure(finished(f"{GRAMMAR_STRANDED} (at output token 2)"), grammar)
    assert (stranded.field, stranded.code) == ("guided_json", "grammar_allows_no_token")
    nan = own_failure(finished(f"{NOT_A_NUMBER} (at output token 1)"), grammar)
    assert (nan.field, nan.code, str(nan)) == (None, "sampling_failed", f"{NOT_A_NUMBER} (at output token 1)")
    assert own_failure(finished(None), grammar) is None  # aborted because the client left: not its fault
