"""Which grammar a chat request asks for, as the engine's `SamplingParams.structured_outputs` dict.

A request names a grammar in one of several ways: OpenAI's `response_format` (`json_object`,
`json_schema`), vLLM's `structured_outputs` object, vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, or a `tool_choice` that forces a call (`required`, a named
function: tools.py builds that schema). They all map onto one dict with exactly one of the keys
`json`, `json_object`, `regex`, `choice`, `grammar`; two sources in one request are a 400 naming
both, as vLLM refuses them, rather than a silent choice of one.

Sizes are bounded here, before a model is loaded or a grammar compiled: a schema is data the
client sent, and a 10 MB one would otherwise reach the grammar compiler. Error messages name the
field and never echo the schema back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator,
                      model_validator)

from kvscope.backend.engine.request import RequestError
from kvscope.backend.server.guards import json_depth

MAX_GRAMMAR_CHARS = 65_536  # a schema, regex or EBNF text as JSON; real ones are a few KB
MAX_SCHEMA_DEPTH = 64  # nesting of a schema's objects and lists
MAX_CHOICES = 256
GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
GuidedChoice = Annotated[str, Field(min_length=1, max_length=1024)]  # one string guided_choice may answer
ChoiceList = Annotated[list[GuidedChoice], Field(min_length=1, max_length=MAX_CHOICES)]


def one_reason(expected: str) -> WrapValidator:
    """pydantic names the branch of a union that failed ("tool_choice.literal[...]"): say what is expected."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(expected) from None

    return WrapValidator(validate)


# vLLM takes a JSON schema as an object or as its text
Schema = Annotated[dict[str, Any] | GrammarText,
                   one_reason(f"a JSON schema: an object, or its text (up to {MAX_GRAMMAR_CHARS} characters)")]
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # OpenAI's rule for names


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(StrictModel):
    name: FunctionName
    description: Annotated[str, Field(max_length=4096)] | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # OpenAI: absent means any object
    # kvscope always enforces the schema: strict false is accepted and changes nothing (as vLLM).
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self


class StructuredOutputsField(StrictModel):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams), the grammar keys only."""

    json_: Schema | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: GrammarText | None = None
    choice: ChoiceList | None = None
    grammar: GrammarText | None = None

    def outputs(self) -> dict[str, Any]:
        """The one grammar it names (RequestError when it names none or several)."""
        named = {k: v for k, v in self.model_dump(by_alias=True).items() if v not in (None, False)}
        if len(named) != 1:
            raise RequestError("structured_outputs", "name exactly one of json, json_object, regex, choice, "
                                                     f"grammar (got {', '.join(named) or 'none'})")
        return named


@dataclass(frozen=True)
class Grammar:
    """A request's grammar: the field that asked for it (for error messages) and the engine's dict."""

    source: str
    outputs: dict[str, Any]


def grammar_of(body: Any, forced_tool_call: dict[str, Any] | None = None) -> Grammar | None:
    """The request's one grammar, or None; RequestError naming the fields when it names several.

    `forced_tool_call` is the schema a `tool_choice` of `required` or a named function forces (tools.py); it
    comes before `response_format`, which shapes the text an answer writes, and a forced call writes none
    (OpenAI's reading; instructor sends both)."""
    named = [g for g in _sources(body, forced_tool_call) if g is not None]
    if forced_tool_call is not None:
        named = [g for g in named if g.source != "response_format"]
    if len(named) > 1:
        others = " and ".join(g.source for g in named[1:])
        raise RequestError(named[0].source, f"{others} also asks for a grammar: send only one of them")
    if named:
        check_size(named[0])
    return named[0] if named else None


def _sources(body: Any, forced_tool_call: dict[str, Any] | None) -> list[Grammar | None]:
    guided = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
    sources = [format_grammar(body.response_format),
               None if body.structured_outputs is None else Grammar("structured_outputs",
                                                                    body.structured_outputs.outputs()),
               None if forced_tool_call is None else Grammar("tool_choice", {"json": forced_tool_call})]
    for field, key in guided.items():
        value = getattr(body, field)
        sources.append(None if value is None else Grammar(field, {key: value}))
    return sources


def format_grammar(fmt: ResponseFormat | None, source: str = "response_format") -> Grammar | None:
    """The grammar of an OpenAI output format (chat's `response_format`, the Responses API's `text.format`)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar(source, {"json_object": True})
    return Grammar(source, {"json": fmt.json_schema.schema_ or {"type": "object"}})


def check_size(grammar: Grammar) -> None:
    """RequestError when the grammar is deeper or longer than the bounds."""
    (value,) = grammar.outputs.values()
    if json_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise RequestError(grammar.source, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
        raise RequestError(grammar.source, f"longer than {MAX_GRAMMAR_CHARS} characters as JSON")


@contextmanager
def named_by_source(grammar: Grammar | None) -> Iterator[None]:
    """The engine refuses a grammar it cannot compile as `sampling.structured_outputs.<key>`: the client sent
    `response_format` or `guided_regex`, so the 400 names that field instead."""
    try:
        yield
    except RequestError as e:
        if grammar is None or not (e.field or "").startswith("sampling.structured_outputs"):
            raise
        raise RequestError(grammar.source, e.reason) from None
