"""The body of OpenAI's Responses API (`POST /v1/responses`), and its `input` as chat messages.

OpenAI keeps responses on its side (`store`, `previous_response_id`, `conversation`, `background`) and
runs tools and reasoning; kvscope keeps nothing and runs neither, so each of those fields is a 400 that
names it and says why, never silently ignored. Fields the body does not declare are refused by
validation, as on the chat route (openai_protocol.py, whose strict base and stream options it shares).
An `input` item is validated here rather than by the route, so that an error names its place
(`input[2].role`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from kvscope.backend.server.openai_errors import OpenAIError, invalid_reason
from kvscope.backend.server.openai_protocol import Name, StreamOptions, StrictBody, Text
from kvscope.backend.server.structured import (FunctionName, Grammar, JsonSchemaFormat, ResponseFormat, check_size,
                                               format_grammar, one_reason)

MAX_ITEMS = 256
# "developer" is OpenAI's newer name for "system"; the chat templates kvscope serves know only "system".
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
NOT_STORED = "kvscope keeps no responses: send the whole conversation as `input`"


class TextFormat(StrictBody):
    """`text.format`: chat's response_format, with a schema's fields beside `type` rather than under `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: Annotated[str, Field(max_length=4096)] | None = None
    strict: bool | None = None  # kvscope always enforces the schema (structured.py)

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if (self.type == "json_schema") != (self.name is not None and self.schema_ is not None):
            raise ValueError("name and schema are required with type json_schema, and only with it")
        return self

    def as_response_format(self) -> ResponseFormat:
        schema = None if self.type != "json_schema" else JsonSchemaFormat(
            name=self.name, schema=self.schema_, description=self.description, strict=self.strict)
        return ResponseFormat(type=self.type, json_schema=schema)


class TextConfig(StrictBody):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class InputPart(StrictBody):
    """A message's text; an earlier answer sent back as input carries its output_text's annotations too."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: Annotated[list[dict[str, Any]], Field(max_length=64)] | None = None
    logprobs: Annotated[list[dict[str, Any]], Field(max_length=100_000)] | None = None


class InputMessage(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[Text | Annotated[list[dict[str, Any]], Field(max_length=64)],
                       one_reason("a string, or a list of up to 64 input_text / output_text parts")]
    id: Name | None = None  # an earlier output item sent back: its id, status and phase change nothing
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


Input = Annotated[Annotated[str, Field(min_length=1, max_length=100_000)]
                  | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_ITEMS)],
                  one_reason(f"a non-empty string, or a list of 1..{MAX_ITEMS} messages")]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class ResponsesBody(StrictBody):
    model: Name | None = None
    input: Input
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=100_000)  # OpenAI's minimum is 16
    temperature: float | None = None  # bounds: SamplingParams
    top_p: float | None = None
    ignore_eos: bool | None = None  # vLLM's extra, as on the other routes (guidellm sends it to fix output lengths)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    metadata: Metadata | None = None  # echoed back, as OpenAI does
    user: Name | None = None  # ids for OpenAI's abuse monitoring: nothing to act on here
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None  # kvscope's prefix cache needs no hint
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    parallel_tool_calls: bool | None = None  # with no tools there are no calls to run in parallel
    tool_choice: Annotated[str, Field(max_length=32)] | dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Declared only to be refused with a reason (refuse_unimplemented).
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: Name | None = None
    conversation: Name | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=16)] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def refuse_unimplemented(self) -> None:
        """400 naming the first field kvscope cannot honour, and why."""
        if self.stream_options is not None:
            self.stream_options.refuse("continuous_usage_stats")
        verbosity = self.text.verbosity if self.text else None
        obfuscation = self.stream_options.include_obfuscation if self.stream_options else None
        refused = {
            "tools": (bool(self.tools), "the Responses route runs no tools; /v1/chat/completions calls functions"),
            "tool_choice": (self.tool_choice not in (None, "auto", "none"), "there are no tools to choose"),
            "store": (bool(self.store), NOT_STORED),
            "previous_response_id": (self.previous_response_id is not None, NOT_STORED),
            "conversation": (self.conversation is not None, NOT_STORED),
            "background": (bool(self.background), "kvscope answers within the request"),
            "reasoning": (self.reasoning is not None, "the served models have no reasoning mode"),
            "include": (bool(self.include), "kvscope has no extra output items to include"),
            "prompt": (self.prompt is not None, "kvscope keeps no prompt templates"),
            "top_logprobs": (bool(self.top_logprobs), "logprobs are served by /v1/chat/completions"),
            "truncation": (self.truncation == "auto",
                           "kvscope never drops the start of a conversation: one too long is a 400"),
            "service_tier": (self.service_tier not in (None, "auto", "default"), "kvscope has one tier"),
            "text.verbosity": (verbosity not in (None, "medium"), "the served models have no verbosity setting"),
            "stream_options": (self.stream_options is not None and not self.stream,
                               "only allowed when stream is true"),
            "stream_options.include_obfuscation": (bool(obfuscation), "kvscope does not pad its stream events"),
        }
        for param, (is_refused, why) in refused.items():
            if is_refused:
                raise OpenAIError(400, f"{param}: not supported by kvscope: {why}", param)

    def grammar(self) -> Grammar | None:
        """The grammar `text.format` asks for, its size checked (RequestError naming text.format)."""
        fmt = self.text.format if self.text else None
        grammar = format_grammar(fmt.as_response_format(), "text.format") if fmt else None
        if grammar is not None:
            check_size(grammar)
        return grammar

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages: the instructions as a system message first, then the input."""
        first = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*first, {"role": "user", "content": self.input}]
        return [*first, *(_message(item, f"input[{i}]") for i, item in enumerate(self.input))]


def _message(item: dict[str, Any], where: str) -> dict[str, str]:
    kind = item.get("type", "message")
    if kind != "message":  # function_call, function_call_output, reasoning, item_reference, ...
        raise OpenAIError(400, f"{where}: {str(kind)[:64]!r} items are not supported by kvscope (it runs no tools, "
                               "keeps no items to refer to: only messages)", f"{where}.type")
    message = _validated(InputMessage, item, where)
    if isinstance(message.content, str):
        return {"role": ROLES[message.role], "content": message.content}
    texts = [_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(message.content)]
    return {"role": ROLES[message.role], "content": "".join(texts)}


def _part_text(part: dict[str, Any], where: str) -> str:
    kind = part.get("type")
    if kind in ("input_image", "input_file", "input_audio"):
        raise OpenAIError(400, f"{where}: {kind} parts are not supported by kvscope (it serves text models)",
                          f"{where}.type")
    return _validated(InputPart, part, where).text


def _validated(model: type[BaseModel], value: dict[str, Any], where: str) -> Any:
    """An item of `input` (validated here, not by the route: the error names its place, `input[2].role`)."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        param = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        raise OpenAIError(400, f"{param}: {invalid_reason(first['msg'])}", param) from None
