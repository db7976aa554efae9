"""The body of OpenAI's Responses API (`POST /v1/responses`), and its `input` as chat messages.

Function tools work as on chat (the client runs them): `tools` of type "function", `tool_choice`,
`parallel_tool_calls`, and `function_call` / `function_call_output` items in the input, which become the
chat history's assistant `tool_calls` and `tool` messages, checked by tools.py as chat's are. `store`
keeps a response for `previous_response_id` in a bounded store with an expiry (response_store.py).
OpenAI's hosted tools (web search, file search, ...), `conversation`, `background` and reasoning are
400s that name the field and say why, never silently ignored. Fields the body does not declare are
refused by validation, as on the chat route (openai_protocol.py, whose strict base and stream options it
shares). An `input` item is validated here rather than by the route, so that an error names its place
(`input[2].role`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from kvscope.backend.server.openai_errors import OpenAIError, invalid_reason
from kvscope.backend.server.openai_protocol import ChatMessage, Name, StreamOptions, StrictBody, Text
from kvscope.backend.server.structured import (FunctionName, Grammar, JsonSchemaFormat, ResponseFormat, check_size,
                                               format_grammar, one_reason)
from kvscope.backend.server.tools import (MAX_TOOLS, FunctionDef, FunctionRef, ToolCall, ToolCalling, ToolDef,
                                          arguments_object)

MAX_ITEMS = 256
# "developer" is OpenAI's newer name for "system"; the chat templates kvscope serves know only "system".
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


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


class FunctionTool(StrictBody):
    """A function tool as the Responses API writes it: chat's definition, without the `function` wrapper."""

    type: Literal["function"]
    name: FunctionName
    description: Annotated[str, Field(max_length=4096)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # kvscope forces the schema whenever it forces a call

    def as_chat(self) -> ToolDef:
        return ToolDef(type="function", function=FunctionDef(name=self.name, description=self.description,
                                                             parameters=self.parameters, strict=self.strict))


class NamedFunction(StrictBody):
    type: Literal["function"]
    name: FunctionName


class FunctionCallItem(StrictBody):
    """An earlier answer's call, sent back as input."""

    type: Literal["function_call"]
    call_id: Name
    name: FunctionName
    arguments: Text  # JSON text, as the response gave it
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class OutputText(StrictBody):
    type: Literal["input_text", "output_text"]
    text: Text


class FunctionCallOutputItem(StrictBody):
    """What the client's tool returned for a call."""

    type: Literal["function_call_output"]
    call_id: Name
    output: Annotated[Text | Annotated[list[OutputText], Field(max_length=64)],
                      one_reason("a string, or a list of up to 64 input_text parts")]
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


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
    parallel_tool_calls: bool | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedFunction | dict[str, Any],
                           one_reason('"none", "auto", "required" or {"type": "function", "name": NAME}')] | None = None
    # Checked item by item (function_tools), so that a hosted tool is refused by its place: tools[1].type
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    store: bool | None = None  # kept for previous_response_id (response_store.py)
    previous_response_id: Name | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Declared only to be refused with a reason (refuse_unimplemented).
    background: bool | None = None
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
            "tool_choice": (isinstance(self.tool_choice, dict),
                            'only "none", "auto", "required" or a function by name: kvscope runs no hosted tools'),
            "conversation": (self.conversation is not None, "kvscope keeps no conversations: send the whole "
                                                             "conversation as `input`, or `previous_response_id` "
                                                             "with `store`"),
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

    def grammar(self, calling: ToolCalling) -> Grammar | None:
        """The grammar a forced `tool_choice` or `text.format` asks for, its size checked (RequestError naming
        the field). A forced call comes first: `text.format` shapes the text an answer writes, and a forced
        call writes none (instructor's RESPONSES_TOOLS sends both)."""
        forced = calling.forced_schema()
        fmt = self.text.format if self.text else None
        if forced is not None:
            grammar = Grammar("tool_choice", {"json": forced})
        else:
            grammar = format_grammar(fmt.as_response_format(), "text.format") if fmt else None
        if grammar is not None:
            check_size(grammar)
        return calling.with_calls(grammar)

    def tool_calling(self, history: list[ChatMessage]) -> ToolCalling:
        """The tools, their choice and the history's calls checked as chat's are (RequestError naming the field)."""
        tools = function_tools(self.tools or [])
        choice = self.tool_choice
        named = FunctionRef(name=choice.name) if isinstance(choice, NamedFunction) else choice
        return ToolCalling.checked(tools, named, self.parallel_tool_calls, history)

    def input_messages(self) -> list[ChatMessage]:
        """The input as chat messages, without the instructions (a stored response keeps these: the next
        response's instructions replace them, as OpenAI's do)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages: list[ChatMessage] = []
        for i, item in enumerate(self.input):
            _append(messages, item, f"input[{i}]")
        return messages

    def instruction_messages(self) -> list[ChatMessage]:
        return [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []


def function_tools(tools: list[dict[str, Any]]) -> list[ToolDef]:
    """The function tools as chat's definitions; any other type is a 400 naming its place."""
    out = []
    for k, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise OpenAIError(400, f"tools[{k}].type: {str(tool.get('type'))[:64]!r} tools are not supported by "
                                   "kvscope: it runs no hosted tools; define functions, which the client runs",
                              f"tools[{k}].type")
        out.append(_validated(FunctionTool, tool, f"tools[{k}]").as_chat())
    return out


def _append(messages: list[ChatMessage], item: dict[str, Any], where: str) -> None:
    """One input item onto the chat history: a message; a function call (joined to the assistant turn it
    follows, as one answer's calls are); a call's output as a tool message."""
    kind = item.get("type", "message")
    if kind == "function_call":
        call = _validated(FunctionCallItem, item, where)
        arguments_object(call.arguments, f"{where}.arguments")  # as chat checks a history's calls
        entry = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or []), _validated_call(entry, where)]
        else:
            messages.append(ChatMessage(role="assistant", tool_calls=[_validated_call(entry, where)]))
    elif kind == "function_call_output":
        output = _validated(FunctionCallOutputItem, item, where)
        messages.append(ChatMessage(role="tool", tool_call_id=output.call_id, content=output.text()))
    elif kind == "message":
        messages.append(_message(item, where))
    else:  # reasoning, item_reference, hosted tools' calls, ...
        raise OpenAIError(400, f"{where}: {str(kind)[:64]!r} items are not supported by kvscope (messages, "
                               "function_call and function_call_output only)", f"{where}.type")


def _validated_call(entry: dict[str, Any], where: str) -> ToolCall:
    return _validated(ToolCall, entry, where)


def _message(item: dict[str, Any], where: str) -> ChatMessage:
    message = _validated(InputMessage, item, where)
    if isinstance(message.content, str):
        return ChatMessage(role=ROLES[message.role], content=message.content)
    texts = [_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(message.content)]
    return ChatMessage(role=ROLES[message.role], content="".join(texts))


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
