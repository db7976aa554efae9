"""Tool calling on the way in: the `tools` and `tool_choice` of a chat request, checked, and the messages
and tool definitions as the chat template will see them.

A template that reads a `tools` variable (Qwen2.5's, Llama 3.1's, Hermes 2 Pro's) gets the definitions
and the history as transformers passes them: assistant `tool_calls` with their arguments as objects,
`tool` messages with their `tool_call_id`. A template without one (SmolLM2-135M-Instruct's plain ChatML,
the demo models' speeches) gets the Hermes convention written into the messages themselves: the tools
as JSON inside `<tools></tools>` in the system message, earlier calls as `<tool_call>` blocks in the
assistant's content, results as `<tool_response>` blocks. Either way the model is asked to answer with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which tool_parser.py reads back.

`tool_choice` "none" hides the tools from the model (OpenAI's meaning: no call is made); "required" and
a named function force the call by a grammar (structured.py) over the JSON of the call itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from kvscope.backend.engine.request import RequestError
from kvscope.backend.server.guards import MAX_JSON_DEPTH, check_utf8, json_depth
from kvscope.backend.server.structured import (MAX_GRAMMAR_CHARS, FunctionName, Grammar, StrictModel, check_size,
                                               one_reason)
from kvscope.backend.server.tool_parser import CLOSE, OPEN, ForcedCallParser, HermesToolParser, Parser

MAX_TOOLS = 128
FORMAT_FIELDS = ("response_format", "text.format")  # the grammars that shape an answer's text (OpenAI's formats)
# Calls a forced "required" answer may hold with parallel_tool_calls: a bound, so that a model that repeats
# its call (greedy SmolLM2 does) ends the list instead of writing calls until max_tokens.
MAX_PARALLEL_CALLS = 8
ToolMode = Literal["none", "auto", "required"]
Messages = list[dict[str, Any]]  # as chat templates read them


class FunctionDef(StrictModel):
    name: FunctionName
    description: Annotated[str, Field(max_length=4096)] | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no arguments
    strict: bool | None = None  # kvscope forces the schema whenever it forces a call


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionRef(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionRef


Tools = Annotated[list[ToolDef], Field(min_length=1, max_length=MAX_TOOLS)]
ToolChoice = Annotated[ToolMode | NamedToolChoice,
                      one_reason('"none", "auto", "required" or {"type": "function", "function": {"name": NAME}}')]


class CalledFunction(StrictModel):
    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]  # JSON text, as the API returned it


class ToolCall(StrictModel):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: CalledFunction


@dataclass(frozen=True)
class ToolCalling:
    """A chat request's tools, checked: what the model is shown, what is forced, how its answer is read."""

    tools: list[ToolDef]
    mode: ToolMode | FunctionRef
    parallel: bool

    @classmethod
    def of(cls, body: Any) -> ToolCalling:
        """From a ChatBody (RequestError naming the field for a tool, choice or history message it refuses)."""
        return cls.checked(body.tools or [], body.tool_choice, body.parallel_tool_calls, body.messages)

    @classmethod
    def checked(cls, tools: list[ToolDef], choice: ToolChoice | FunctionRef | None, parallel: bool | None,
                history: list[Any]) -> ToolCalling:
        """From the tools, the choice (chat's, or a function already named) and the history's messages."""
        named = NamedToolChoice(type="function", function=choice) if isinstance(choice, FunctionRef) else choice
        mode = tool_mode(tools, named)
        check_tools(tools)
        check_history(history)
        return cls(tools, mode, parallel is not False)

    def forced_schema(self) -> dict[str, Any] | None:
        return forced_call_schema(self.tools, self.mode, self.parallel)

    def with_calls(self, grammar: Grammar | None) -> Grammar | None:
        """A response format beside tools the model may call ("auto"): the answer is a call or the format's JSON,
        as OpenAI's models choose between calling and answering in the format (calls_or)."""
        if self.mode != "auto" or grammar is None or grammar.source not in FORMAT_FIELDS:
            return grammar
        return calls_or(grammar, self.tools)

    def template_inputs(self, messages: Messages, native: bool) -> tuple[Messages, list[dict[str, Any]] | None]:
        shown = None if self.mode == "none" else self.tools
        return template_inputs(messages, shown, native, self.parallel)

    def parser(self) -> Parser | None:
        """A new reader of one choice's answer; None: the answer is plain content (no tools, or "none")."""
        if self.mode == "none":
            return None
        if self.mode == "auto":
            return HermesToolParser(None if self.parallel else 1)
        return ForcedCallParser(self.mode.name if isinstance(self.mode, FunctionRef) else None)


def tool_mode(tools: list[ToolDef] | None, choice: ToolChoice | None) -> ToolMode | FunctionRef:
    """What the request asks of the model: no tools, may call, must call, must call this one.

    RequestError for a choice that names no tool the request defines."""
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice", "needs tools: there is no tool to choose")
        return "none"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise RequestError("tool_choice", f"no tool named {choice.function.name!r} in tools")
        return choice.function
    return choice or "auto"


def check_tools(tools: list[ToolDef]) -> None:
    """Distinct names (a call names its function), schemas within structured.py's bounds."""
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise RequestError("tools", "two tools have the same name")
    for k, tool in enumerate(tools):
        check_size(Grammar(f"tools.{k}.function.parameters", {"json": tool.function.parameters or {}}))


def forced_call_schema(tools: list[ToolDef], mode: ToolMode | FunctionRef, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema a forced choice puts on the whole answer (None when nothing is forced).

    Named: the function's arguments, as vLLM does. Required: a list of calls (1..MAX_PARALLEL_CALLS, or exactly
    one without parallel_tool_calls), each {"name": one of the tools, "arguments": its parameters}."""
    if isinstance(mode, FunctionRef):
        return _parameters(next(t for t in tools if t.function.name == mode.name))
    if mode != "required":
        return None
    call, defs = call_schema(tools)
    return {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
            **({"$defs": defs} if defs else {})}


def call_schema(tools: list[ToolDef]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One call, {"name": one of the tools, "arguments": its parameters}, and the definitions its refs need at
    the root of the schema it goes into."""
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "arguments": _defs_at_root(_parameters(t), f"t{k}_", defs)},
              "required": ["name", "arguments"], "additionalProperties": False} for k, t in enumerate(tools)]
    return {"anyOf": calls}, defs


def calls_or(grammar: Grammar, tools: list[ToolDef]) -> Grammar:
    """The answer as one Hermes tool-call block around a call's JSON, or the format's JSON: one EBNF grammar
    (xgrammar's union of the two, each JSON compact as the engine compiles JSON). RequestError naming the
    format's field when a schema does not compile."""
    import xgrammar

    ((kind, value),) = grammar.outputs.items()
    call, defs = call_schema(tools)
    try:
        answer = xgrammar.Grammar.from_json_schema(json.dumps(value if kind == "json" else {"type": "object"}),
                                                   any_whitespace=False)
        called = xgrammar.Grammar.from_json_schema(json.dumps({**call, **({"$defs": defs} if defs else {})}),
                                                   any_whitespace=False)
        block = xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf(f'root ::= "{OPEN}\\n"'), called,
                                        xgrammar.Grammar.from_ebnf(f'root ::= "\\n{CLOSE}"'))
        either = Grammar(grammar.source, {"grammar": str(xgrammar.Grammar.union(answer, block))})
    except (RuntimeError, ValueError) as e:
        raise RequestError(grammar.source, f"with the tools' calls beside it, does not compile: {str(e)[:200]}") \
            from None
    check_size(either)
    return either


DEFS_KEYS = ("$defs", "definitions")  # JSON Schema's name, and draft 7's (pydantic v1 wrote it)


def _defs_at_root(parameters: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters with their definitions moved into `defs` (the wrapper schema's root) under
    `prefix` + name, and every local `$ref` to them rewritten to match: under the call list a ref such as
    `#/$defs/Address` (what pydantic writes for a nested model) resolves against the wrapper's root, where
    it found nothing. The prefix keeps two tools' same-named definitions apart."""
    own = {name: body for key in DEFS_KEYS if isinstance(parameters.get(key), dict)
           for name, body in parameters[key].items()}
    if not own:
        return parameters
    moved = {k: v for k, v in parameters.items() if k not in DEFS_KEYS}
    for name, body in own.items():
        defs[prefix + name] = _refs_renamed(body, prefix)
    return _refs_renamed(moved, prefix)


def _refs_renamed(node: Any, prefix: str) -> Any:
    """A copy of node whose `#/$defs/X...` and `#/definitions/X...` refs point at `#/$defs/<prefix>X...`."""
    if isinstance(node, list):
        return [_refs_renamed(item, prefix) for item in node]
    if not isinstance(node, dict):
        return node
    renamed = {k: _refs_renamed(v, prefix) for k, v in node.items()}
    ref = node.get("$ref")
    for key in DEFS_KEYS:
        if isinstance(ref, str) and ref.startswith(f"#/{key}/"):
            renamed["$ref"] = f"#/$defs/{prefix}{ref[len(key) + 3:]}"
    return renamed


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def check_history(messages: list[Any]) -> None:
    """Tool messages answer a call by its id; calls come from the assistant with arguments that are a JSON
    object (templates read them as one). RequestError naming the message's field."""
    for k, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise RequestError(f"messages.{k}.tool_call_id", "a tool message names the call it answers")
        if m.tool_call_id is not None and m.role != "tool":
            raise RequestError(f"messages.{k}.tool_call_id", "only tool messages answer a call")
        if m.tool_calls and m.role != "assistant":
            raise RequestError(f"messages.{k}.tool_calls", "only the assistant makes tool calls")
        for j, call in enumerate(m.tool_calls or []):
            arguments_object(call.function.arguments, f"messages.{k}.tool_calls.{j}.function.arguments")


def arguments_object(text: str, field: str) -> dict[str, Any]:
    """The arguments as the templates will re-encode and the tokenizer read them: a JSON object nested no
    deeper than a body may be (json.dumps recurses, one level deeper than the text: ~1,000 levels raised
    RecursionError), whose strings are all UTF-8 (a `\\ud800` escape decodes to a lone surrogate, which
    no tokenizer encodes)."""
    deep = RequestError(field, f"nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        arguments = json.loads(text)
    except RecursionError:
        raise deep from None
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise RequestError(field, "not a JSON object")
    if json_depth(arguments, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise deep
    check_utf8(json.dumps(arguments, ensure_ascii=False), field)
    return arguments


# ---- what the template sees --------------------------------------------------------------------------------


def template_inputs(messages: Messages, tools: list[ToolDef] | None, native: bool,
                    parallel: bool) -> tuple[Messages, list[dict[str, Any]] | None]:
    """(messages, tools) for a template that reads `tools` (native) or one that does not (Hermes, written
    into the messages). `tools` None: the model is shown none (no tools, or tool_choice "none")."""
    if native:
        return [_native_message(m) for m in messages], [t.model_dump(exclude_none=True) for t in tools or []] or None
    written = [_hermes_message(m) for m in messages]
    return (written if not tools else _with_tools_prompt(written, tools, parallel)), None


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    """transformers' shape: a call's arguments as an object (templates apply tojson to them)."""
    if "tool_calls" not in message:
        return message
    calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _hermes_message(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if "tool_calls" not in message:
        return message
    blocks = [hermes_call(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    content = "\n".join(filter(None, [message.get("content") or "", *blocks]))
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def _with_tools_prompt(messages: Messages, tools: list[ToolDef], parallel: bool) -> Messages:
    """The Hermes tools block at the end of the system message (a new first message when there is none)."""
    block = hermes_tools_prompt(tools, parallel)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def hermes_tools_prompt(tools: list[ToolDef], parallel: bool) -> str:
    """NousResearch's Hermes function-calling prompt, the convention Qwen2.5 and many fine-tunes learned."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    how_many = "one or more functions" if parallel else "at most one function"
    return ("# Tools\n\n"
            f"You may call {how_many} to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
