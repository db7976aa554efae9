"""Tool calling and structured outputs on the API side: the grammar a request names (structured.py), the
tools and history the template sees (tools.py), and calls read back out of the model's text
(tool_parser.py), fed whole or in every possible split."""

from __future__ import annotations

import json

import pytest

from kvscope.backend.engine.request import RequestError
from kvscope.backend.server.tool_parser import ForcedCallParser, HermesToolParser, parse

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


@pytest.mark.parametrize("block", ['<tool_call>{"name": "f", "arguments": {</tool_call>',
                                   '<tool_call>["f"]</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                                   '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
                                   '<tool_call>{"name": "f", "arguments": {}}'])  # never closed
def test_a_block_that_is_not_a_call_stays_content_as_written(block: str) -> None:
    assert parse(HermesToolParser(), "a " + block) == ("a " + block, [])


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
            content = "".join(p for p in pieces if isinstance(p, str)) or None
            assert content == whole_content
            assert calls_of([p for p in pieces if isinstance(p, dict)]) == calls_of(whole_calls)


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


def test_a_forced_answer_cut_short_is_content() -> None:
    assert parse(ForcedCallParser("f"), '{"city": "Pa') == ('{"city": "Pa', [])
