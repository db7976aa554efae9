"""Checks every route runs before its handler: who may call, and what a body may be.

A browser lets any page send a simple POST (text/plain, form or multipart body: no CORS preflight)
to any server, a localhost one included, and lets it open websockets anywhere. So:
- a body that changes something must say `Content-Type: application/json` (415 otherwise): no page
  can send that cross-site without a preflight, which this server only grants to `--cors-origin`s;
- a browser `Origin` on a POST (or a websocket) must be the server's own, a `--cors-origin` or the
  dashboard's (403 otherwise); clients that are not browsers send no Origin and are not concerned;
  a DELETE without a body is let through (a browser preflights every DELETE);
- on a loopback bind the `Host` must be a loopback name (403 otherwise): DNS rebinding points a
  hostile name at 127.0.0.1, and the Host header is what gives it away;
- off loopback, watching runs (GET /metrics included) needs the token too, unless the server was
  started to show them publicly;
- JSON bodies may nest at most MAX_JSON_DEPTH deep (400): deeper ones overflow the decoder's stack.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

import msgspec
from litestar.connection import ASGIConnection, Request
from litestar.exceptions import (ClientException, HTTPException, NotAuthorizedException, PermissionDeniedException,
                                 WebSocketException)
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard
from litestar.utils import ensure_async_callable

from kvscope.backend.engine.request import RequestError


MAX_JSON_DEPTH = 32  # an inline scenario nests 4 deep; the decoder's own limit is ~1000
CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
HOST_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^:\[\]]+)(?::\d+)?$")  # a name or [IPv6], then a port
# snapshots, traces, the websocket, saved runs, and the API runs' numbers (GET /metrics)
WATCH_PATHS = ("/api/runs", "/ws/runs", "/api/library", "/metrics")


def require_token(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Off loopback, changing routes (and watching, see check_watch_token) need the server's bearer token."""
    token = connection.app.state.token
    if token and connection.headers.get("authorization", "") != f"Bearer {token}":
        raise NotAuthorizedException("this server needs 'Authorization: Bearer <token>' to change runs")


def check_host(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """On a loopback bind, refuse a Host that is not a loopback name (DNS rebinding)."""
    if not connection.app.state.loopback:
        return
    host = connection.headers.get("host", "")
    if not is_loopback_name(host):
        raise PermissionDeniedException(f"Host: {host!r} is not a loopback name; this server answers only "
                                        "to localhost, 127.0.0.1 and [::1]")


def is_loopback_name(host: str) -> bool:
    """localhost, a 127.x.x.x address or [::1], with or without a port."""
    match = HOST_RE.match(host)
    if match is None:
        return False
    name = match[1].strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_origin(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Refuse a cross-site browser on a changing route or a websocket."""
    if connection.scope["type"] == "http" and connection.scope["method"] not in CHANGING_METHODS:
        return
    origin = connection.headers.get("origin")
    if origin is None:
        return
    scheme = "https" if connection.url.scheme in ("https", "wss") else "http"
    own = f"{scheme}://{connection.headers.get('host', '')}".lower()
    origin = origin.rstrip("/").lower()
    if origin != own and origin not in connection.app.state.trusted_origins:
        raise PermissionDeniedException(f"Origin: {origin!r} may not use this server "
                                        "(allow a browser origin with --cors-origin)")


def check_watch_token(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Off loopback, watching runs needs the token unless the server was started with public watching."""
    state = connection.app.state
    if not state.loopback and not state.public_watch and connection.url.path.startswith(WATCH_PATHS):
        try:
            require_token(connection, handler)
        except NotAuthorizedException:
            raise NotAuthorizedException("this server needs 'Authorization: Bearer <token>' to watch runs "
                                         "(or start it with --public-watch)") from None


async def check_json_body(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A changing request's body is JSON, declared so, and not nested too deep."""
    if connection.scope["type"] != "http" or connection.scope["method"] not in CHANGING_METHODS:
        return
    media_type = connection.headers.get("content-type", "").split(";")[0].strip().lower()
    if connection.scope["method"] == "DELETE" and not media_type and connection.headers.get("content-length", "0") == "0":
        return  # a DELETE has nothing to say (and a browser preflights one anyway)
    if media_type != "application/json":
        raise HTTPException(status_code=415, detail=f"Content-Type: {media_type or 'none'} given; "
                                                    "bodies must be application/json")
    assert isinstance(connection, Request)
    body = await connection.body()  # cached for the handler; 413 past the size limit
    try:
        depth = json_depth(msgspec.json.decode(body), MAX_JSON_DEPTH)
    except RecursionError:
        depth = MAX_JSON_DEPTH + 1
    except msgspec.DecodeError:
        return  # not JSON: the handler's own parsing says so with a 400
    if depth > MAX_JSON_DEPTH:
        raise ClientException(f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels")


def json_depth(value: object, limit: int) -> int:
    """How deep arrays and objects nest in a decoded JSON value (a scalar: 0), counted without recursion (a
    10,000-deep value must not overflow the stack that measures it) and no further than one past `limit`."""
    deepest = 0
    stack: list[tuple[Iterable, int]] = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack and deepest <= limit:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return deepest


def check_utf8(text: str, field: str) -> None:
    """RequestError naming the field when the text holds a lone surrogate: JSON's `\\ud800` escape decodes
    to one, and no tokenizer (nor UTF-8) encodes it. The body's decoder refuses them; a JSON text inside a
    field (a call's arguments) is decoded by Python's, which does not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(field, f"not UTF-8: a lone surrogate (U+{ord(text[e.start]):04X}) at character "
                                  f"{e.start}, from an escape such as \\ud800 without its pair") from None


def closing_websockets(guard: Guard) -> Guard:
    """The guard, refusing a websocket with close code 4000 + the HTTP status (Litestar would say 4500)."""

    async def checked(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        try:
            await ensure_async_callable(guard)(connection, handler)
        except HTTPException as e:
            if connection.scope["type"] != "websocket":
                raise
            raise WebSocketException(detail=e.detail, code=4000 + e.status_code) from None

    return checked


CONNECTION_GUARDS = [closing_websockets(g) for g in (check_host, check_origin, check_watch_token, check_json_body)]
