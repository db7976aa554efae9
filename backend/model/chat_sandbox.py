"""The chat-template renderer's own process: one JSON request a line on stdin, one JSON answer a line on stdout.

A chat template is code that came with a downloaded model. Jinja's sandbox keeps it from reaching
outside the template (no attribute escapes, no files), but not from building a gigabyte in one
expression (`'x' * 10**9`, a `replace` or `join` that multiplies) or looping for minutes; no check
inside the same process can stop a single C call. So templates render here, in a process with an
address-space limit (a MemoryError, reported), an output limit, and a parent (chat.py) that kills it
past the time limit. It imports nothing of kvscope, so it starts in a few tens of milliseconds.

Request: {"template", "messages", "tools" (or null), "tokens" (bos_token, eos_token), "max_chars"}.
Answer: {"text"} or {"error": "refused" | "failed" | "too_long" | "memory", "detail"}.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

READY = "ready"


class OutputTooLong(Exception):
    pass


def main(max_mb: int) -> None:
    limit_address_space(max_mb)
    print(READY, flush=True)
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)


def limit_address_space(max_mb: int) -> None:
    """At most max_mb MB more than the interpreter holds now (it maps tens of MB before any template)."""
    statm = Path("/proc/self/statm")  # Linux; elsewhere the limit counts from 0
    now = os.sysconf("SC_PAGE_SIZE") * int(statm.read_text().split()[0]) if statm.exists() else 0
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = now + max_mb * 1024**2
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def answer(request: dict[str, Any]) -> dict[str, str]:
    try:
        return {"text": render(request["template"], request["messages"], request.get("tools"), request["tokens"],
                               request["max_chars"])}
    except OutputTooLong:
        return {"error": "too_long"}
    except MemoryError:
        return {"error": "memory"}
    except jinja2.TemplateError as e:  # raise_exception() on purpose, a syntax error, a sandbox refusal
        return {"error": "refused", "detail": str(e)}
    except Exception as e:  # noqa: BLE001 - the template's own bug (1 + 'a', a recursion) is its answer
        return {"error": "failed", "detail": f"{type(e).__name__}: {e}"}


def render(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tokens: dict[str, str],
           max_chars: int) -> str:
    """As transformers' apply_chat_template (generation prompt on), stopped past max_chars of output."""
    pieces, size = [], 0
    for piece in _compile(template).generate(messages=messages, add_generation_prompt=True, tools=tools, **tokens):
        size += len(piece)
        if size > max_chars:
            raise OutputTooLong
        pieces.append(piece)
    return "".join(pieces)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(template)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


if __name__ == "__main__":
    main(int(sys.argv[1]))
