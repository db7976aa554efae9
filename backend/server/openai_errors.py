"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the status it says.

Every failure under /v1 (and of vLLM's /tokenize and /detokenize) is answered here, once, at the edge:
a user's mistake is a 4xx naming the field, a full queue a 429 with Retry-After, a failed run a 409 the
official client retries, and nothing a client sent is ever a 5xx.
"""

from __future__ import annotations

from collections.abc import Callable

from litestar import MediaType, Request, Response, Router
from litestar.exceptions import HTTPException, ValidationException

from kvscope.backend.engine.request import RequestError
from kvscope.backend.errors import pydantic_reason
from kvscope.backend.model.chat import ChatTemplateError
from kvscope.backend.model.loader import ModelLoadError, missing_package
from kvscope.backend.server.grammar_compiles import ClientGone
from kvscope.backend.server.limits import WeightMemoryError
from kvscope.backend.server.run_errors import RequestFailed, RunBusy, RunError, RunFailed


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(e: OpenAIError) -> Response:
    return Response(e.body(), status_code=e.status, media_type=MediaType.JSON, headers=e.headers)


def to_openai_error(_: Request, exc: Exception) -> Response:
    """One edge for every failure of these routes: user errors are 4xx, never 5xx."""
    return error_response(as_openai_error(exc))


def as_openai_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestError):  # the engine's field names are "sampling.x" where OpenAI's are "x"
        return OpenAIError(400, str(exc), exc.field.removeprefix("sampling."))
    if isinstance(exc, RunBusy):
        return OpenAIError(429, str(exc), None, "rate_limit_exceeded", "rate_limit_error",
                           {"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, WeightMemoryError):  # the model the client named needs weights the server has no room for
        return OpenAIError(400, str(exc), "model")
    if isinstance(exc, RunFailed):
        return run_failed(exc)
    if isinstance(exc, RequestFailed):
        return request_failed(exc)
    if isinstance(exc, ClientGone):  # nobody reads it: nginx's "client closed request"
        return OpenAIError(499, "the client went away", type="client_closed_request")
    if isinstance(exc, RunError):  # the API's run could not start: the server's limits, not the request
        return OpenAIError(503, str(exc), type="server_error")
    if isinstance(exc, ChatTemplateError):
        return OpenAIError(400, str(exc), "messages")
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        return invalid_body(exc.extra[0] if isinstance(exc.extra[0], dict) else {})
    if isinstance(exc, HTTPException):
        return OpenAIError(exc.status_code, str(exc.detail))
    if isinstance(exc, ModelLoadError):
        return OpenAIError(503, f"the model cannot be loaded: {exc}", type="server_error")
    return OpenAIError(500, f"internal error: {type(exc).__name__}", type="server_error")


def invalid_body(first: dict) -> OpenAIError:
    """A body that failed validation: a 400 naming the first field at fault."""
    param = first.get("key") or None
    return OpenAIError(400, f"{param or 'body'}: {invalid_reason(str(first.get('message')))}", param)


def invalid_reason(message: str) -> str:
    """pydantic's message for a field, as a client reads it."""
    reason = pydantic_reason(message)
    if reason == "Extra inputs are not permitted":  # pydantic's words for a field the body does not declare
        return "not supported by kvscope"
    return reason


def run_failed(exc: RunFailed) -> OpenAIError:
    """The run failed under the request: a 409 (the run's state, not the request, was at fault; never a 5xx,
    so a failing run cannot pass for a failing server), which the official client retries on a fresh run."""
    return OpenAIError(409, f"the server's run failed under this request ({exc.cause}); the next request starts "
                            "a fresh run: try again", None, "run_failed", "server_error", {"Retry-After": "1"})


def request_failed(exc: RequestFailed) -> OpenAIError:
    """The request's own input could not be satisfied (its grammar allowed no token, or an answer its schema
    refuses): a 400 naming the field, as OpenAI refuses what a request asks; the run and the others go on."""
    return OpenAIError(400, str(exc), exc.field, exc.code)


def model_not_found(name: str, served: list[str]) -> OpenAIError:
    install = missing_package(name)
    reason = f"is not installed (run: {install})" if install else \
        f"is not served here; this server serves {', '.join(map(repr, served))}"
    return OpenAIError(404, f"model {name!r} {reason}", "model", "model_not_found")


Handler = Callable[[Request, Exception], Response]


def openai_errors_under_v1(handler: Handler) -> Handler:
    """An app-level handler that answers in OpenAI's shape under /v1 (404s and 405s never reach the /v1 router)."""

    def answer(request: Request, exc: Exception) -> Response:
        if request.url.path == "/v1" or request.url.path.startswith("/v1/"):
            return to_openai_error(request, exc)
        return handler(request, exc)

    return answer


# Keyed like app.py's handlers, so that these (the nearer layer) win for the routes they are given.
OPENAI_ERROR_HANDLERS: dict = {exc: to_openai_error for exc in (
    OpenAIError, RequestError, ChatTemplateError, HTTPException, ModelLoadError, RunBusy, RunError, RunFailed,
    RequestFailed, ClientGone, Exception)}


def v1_router(handlers: list) -> Router:
    """A router under /v1 whose every failure is answered in OpenAI's shape."""
    return Router(path="/v1", route_handlers=handlers, exception_handlers=OPENAI_ERROR_HANDLERS,
                  tags=["OpenAI-compatible"])
