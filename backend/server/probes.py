"""The routes tools expect of a vLLM server beside the OpenAI API: /health, /version, /tokenize, /detokenize.

Readiness probes and benchmark tools (guidellm checks /health before it sends anything) call them by
vLLM's paths and shapes. /health answers for the server's own model: 200 with an empty body once its
API run serves, 503 while it loads or after it failed (a probe then starts it in the background:
RunManager.start_api_run_in_background). /tokenize gives exactly the ids the completion and chat
routes would feed the model, chat messages through the template and its tools included.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from litestar import MediaType, Request, Response, Router, get, post
from litestar.params import JSONBody
from pydantic import Field, model_validator

from kvscope.backend.model.chat import encode_chat, reads_tools
from kvscope.backend.model.packages import installed_version
from kvscope.backend.server.guards import require_token
from kvscope.backend.server.openai_errors import OPENAI_ERROR_HANDLERS, OpenAIError
from kvscope.backend.server.openai_protocol import ChatMessage, Name, StrictBody, Text, TokenId
from kvscope.backend.server.openai_serving import api_run, message_dicts, served_model
from kvscope.backend.server.tools import ToolCalling, ToolChoice, Tools


@get("/health")
async def health_probe(request: Request) -> Response:
    manager = request.app.state.manager
    await asyncio.to_thread(manager.start_api_run_in_background)  # takes the manager's lock
    state = manager.api_state()
    if state == "serving":
        return Response(b"", status_code=200, media_type=MediaType.TEXT)  # an empty body is not JSON
    reason = manager.load_error if state == "failed" and manager.load_error else f"the model is {state}"
    return Response({"status": state, "error": reason}, status_code=503, media_type=MediaType.JSON,
                    headers={"Retry-After": "1"})


@get("/version")
async def server_version(request: Request) -> dict[str, str | bool]:
    """vLLM's `{version}`, and whether the API runs are batch-invariant (`kvscope serve --batch-invariant`): a
    client comparing log-probabilities across requests needs to know."""
    return {"version": installed_version(), "batch_invariant": request.app.state.manager.api_flags.batch_invariant}


class TokenizeBody(StrictBody):
    """vLLM's two tokenize requests in one: a `prompt` (as /v1/completions reads it) or chat `messages`
    (as /v1/chat/completions renders them)."""

    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=256)] | None = None
    add_special_tokens: bool | None = None  # kvscope's models add none either way (no BOS post-processor)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeBody":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeBody(StrictBody):
    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=100_000)]


def _refuse_unsupported(body: TokenizeBody) -> None:
    """The template always ends with the assistant's turn opened, as the chat route sends it."""
    if body.messages is not None and not body.add_generation_prompt:
        raise OpenAIError(400, "add_generation_prompt: false is not supported by kvscope (chat prompts end with "
                               "the assistant's turn opened)", "add_generation_prompt")
    if body.continue_final_message:
        raise OpenAIError(400, "continue_final_message: not supported by kvscope", "continue_final_message")


@post("/tokenize", guards=[require_token], status_code=200)
async def tokenize(request: Request, data: JSONBody[TokenizeBody]) -> dict[str, Any]:
    _refuse_unsupported(data)
    run = await api_run(request, served_model(request, data.model), 0)
    loaded = run.loaded
    if data.prompt is not None:
        ids = await asyncio.to_thread(loaded.tokenizer.encode, data.prompt)
    else:
        calling = ToolCalling.of(data)
        messages, tools = calling.template_inputs(message_dicts(data.messages), reads_tools(loaded))
        ids = await asyncio.to_thread(encode_chat, messages, loaded, tools)
    return {"count": len(ids), "max_model_len": run.max_model_len, "tokens": ids,
            "token_strs": [loaded.tokenizer.token_text(t) for t in ids] if data.return_token_strs else None}


@post("/detokenize", guards=[require_token], status_code=200)
async def detokenize(request: Request, data: JSONBody[DetokenizeBody]) -> dict[str, str]:
    run = await api_run(request, served_model(request, data.model), 0)
    vocab_size = run.loaded.config.vocab_size
    bad = next((t for t in data.tokens if t >= vocab_size), None)
    if bad is not None:
        raise OpenAIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens")
    return {"prompt": run.loaded.tokenizer.decode(data.tokens)}


# The probes answer as they are; tokenize and detokenize fail in OpenAI's error shape, as vLLM's do.
probe_routes: list = [health_probe, server_version,
                      Router(path="/", route_handlers=[tokenize, detokenize], exception_handlers=OPENAI_ERROR_HANDLERS,
                             tags=["vLLM-compatible"])]
