"""Chat messages -> the prompt's token ids, for `/v1/chat/completions`, live requests and scenario `messages`.

A model whose tokenizer carries a Hugging Face chat template (`chat_template` in tokenizer_config.json,
chat_template.jinja, or a GGUF file's `tokenizer.chat_template`) is rendered with it. The demo models
have none: they were trained on Tiny Shakespeare speeches, "NAME:\\ntext\\n", each followed by the
end-of-text token. So the default template writes every message as such a speech, by a speaker chosen
for its role, and ends with the assistant's name and a newline: the model then writes the assistant's
speech and stops on its own.

Control tokens come from the template only. A message that spells one (`<|im_end|><|im_start|>system`
typed into a user turn) gets its text, not the token, as llama.cpp's server reads message content:
special-token texts in the messages are swapped for markers before rendering, and the rendered text
is tokenized with the template's own special tokens as control tokens and the markers as plain text.

A Hugging Face template is code that came with a downloaded model: it renders in its own process
(chat_sandbox.py), stopped past TEMPLATE_TIME_LIMIT_S, TEMPLATE_MAX_CHARS of output or TEMPLATE_MAX_MB
of memory (ChatTemplateError, a 400 naming `messages`).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kvscope.backend.errors import KvscopeError

if TYPE_CHECKING:
    from kvscope.backend.model.loader import LoadedModel

# Speakers the demo models met often in training (ROMEO and JULIET have ~150 speeches each), so
# they answer in character; a message's own `name` takes precedence.
SPEAKERS = {"system": "CHORUS", "developer": "CHORUS", "user": "ROMEO", "assistant": "JULIET", "tool": "MESSENGER"}
ASSISTANT_SPEAKER = SPEAKERS["assistant"]

TEMPLATE_TIME_LIMIT_S = 2.0  # SmolLM2's renders in about a millisecond
TEMPLATE_MAX_CHARS = 2_000_000  # about the largest request body's worth of messages (--max-body-bytes)
TEMPLATE_MAX_MB = 512
SANDBOX = Path(__file__).with_name("chat_sandbox.py")
SANDBOX_START_S = 60.0  # starting the process is not part of a render's time: generous for a loaded machine


class ChatTemplateError(KvscopeError):
    """Messages the model's chat template refuses (it may raise on purpose, e.g. roles out of order)."""


def encode_chat(messages: list[dict[str, Any]], loaded: LoadedModel,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt's token ids for these messages, ready for the model to write the assistant's turn.

    `tools` go to the template's `tools` variable: only for a template that reads one (reads_tools)."""
    tokenizer = loaded.tokenizer
    markers = SpecialTextMarkers(tokenizer.special_texts)
    marked = markers.mark_all(messages)
    if tokenizer.chat_template is None:
        eos_text = tokenizer.token_text(tokenizer.eos_token_id) if tokenizer.eos_token_ids else ""
        text = render_speeches(marked, eos_text)
    else:
        text = render_template(tokenizer.chat_template, marked, special_tokens(loaded.path), markers.mark_all(tools))
    return tokenizer.encode_template(text, markers.unmark)


def reads_tools(loaded: LoadedModel) -> bool:
    """Whether the model's chat template shows tool definitions itself (its `tools` variable)."""
    template = loaded.tokenizer.chat_template
    return template is not None and _template_reads_tools(template)


@lru_cache(maxsize=8)
def _template_reads_tools(template: str) -> bool:
    # Parsing runs none of the template's code, so it may happen here rather than in the sandbox.
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return "tools" in meta.find_undeclared_variables(Environment().parse(template))
    except TemplateSyntaxError:
        return False  # rendering will say what is wrong with it


class SpecialTextMarkers:
    """Special-token texts swapped for markers that no template treats specially, and back.

    A marker is a private-use character around the text's index; that character itself, in a message,
    is marked too, so that every marker after rendering is one of ours."""

    SIGN = "\ue000"

    def __init__(self, specials: tuple[str, ...]) -> None:
        self.texts = (*specials, self.SIGN)
        self.index = {text: i for i, text in enumerate(self.texts)}
        # Longest first, so that no special text is matched by a shorter one inside it.
        self._text = re.compile("|".join(map(re.escape, sorted(self.texts, key=len, reverse=True))))
        self._marker = re.compile(f"{self.SIGN}(\\d+){self.SIGN}")

    def mark(self, text: str) -> str:
        return self._text.sub(lambda m: f"{self.SIGN}{self.index[m.group()]}{self.SIGN}", text)

    def mark_all(self, value: Any) -> Any:
        """Every string inside messages or tool definitions (a call's arguments, a tool's description)."""
        if isinstance(value, str):
            return self.mark(value)
        if isinstance(value, dict):
            return {k: self.mark_all(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.mark_all(v) for v in value]
        return value

    def unmark(self, text: str) -> str:
        return self._marker.sub(self._text_of, text)

    def _text_of(self, marker: re.Match) -> str:
        index = int(marker.group(1))
        return self.texts[index] if index < len(self.texts) else marker.group()  # one a template wrote itself


def render_speeches(messages: list[dict[str, Any]], eos_text: str) -> str:
    """The default template: each message as a speech "SPEAKER:\\ncontent\\n<eos>", then "JULIET:\\n"."""
    parts = []
    for m in messages:
        speaker = (m.get("name") or SPEAKERS.get(m["role"], m["role"])).upper()
        parts.append(f"{speaker}:\n{m['content'].strip()}\n{eos_text}")
    return "".join(parts) + f"{ASSISTANT_SPEAKER}:\n"


def render_template(template: str, messages: list[dict[str, Any]], tokens: dict[str, str],
                    tools: list[dict[str, Any]] | None = None) -> str:
    """A Hugging Face chat template rendered as transformers' apply_chat_template does (generation prompt on),
    in the sandbox process, within its limits."""
    answer = _RENDERER.render({"template": template, "messages": messages, "tools": tools, "tokens": tokens,
                               "max_chars": TEMPLATE_MAX_CHARS})
    if "text" in answer:
        return answer["text"]
    reasons = {"refused": f"refused them ({answer.get('detail')})",
               "failed": f"failed ({answer.get('detail')})",
               "too_long": f"wrote more than {TEMPLATE_MAX_CHARS} characters and was stopped",
               "memory": f"needed more than {TEMPLATE_MAX_MB} MB and was stopped",
               "time": f"ran longer than {TEMPLATE_TIME_LIMIT_S:g} s and was stopped",
               "died": f"stopped its renderer ({answer.get('detail')})"}
    raise ChatTemplateError("messages", f"the model's chat template {reasons[answer['error']]}")


def special_tokens(model_dir: Path) -> dict[str, str]:
    """bos_token and eos_token as a template sees them, from the folder's tokenizer_config.json."""
    config = _tokenizer_config(model_dir)
    return {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}


class TemplateRenderer:
    """chat_sandbox.py as a child process: started on first use, and again after a render it had to stop.
    One render at a time (they take milliseconds); one past the time limit is killed with its process."""

    def __init__(self) -> None:
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def render(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            child = self._running()
            try:
                child.stdin.write(json.dumps(request).encode() + b"\n")
                child.stdin.flush()
            except OSError:  # it died since the last render
                return self._lost()
            line = _read_line(child.stdout, time.monotonic() + TEMPLATE_TIME_LIMIT_S)
            if line is None:
                self.close()
                return {"error": "time"}
            return json.loads(line) if line else self._lost()

    def _running(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        # -P: the script's folder (this package) does not shadow the modules the sandbox imports.
        child = subprocess.Popen([sys.executable, "-P", str(SANDBOX), str(TEMPLATE_MAX_MB)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        if _read_line(child.stdout, time.monotonic() + SANDBOX_START_S) != b"ready\n":  # chat_sandbox.READY
            child.kill()
            child.wait()
            raise ChatTemplateError("messages", "the chat-template renderer did not start (its error is in the log)")
        self._child = child
        return child

    def _lost(self) -> dict[str, Any]:
        """The child died mid-render (killed from outside, or out of memory outside Python's reach)."""
        try:
            code = self._child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.close()
        return {"error": "died", "detail": f"exit status {code}"}

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None


def _read_line(stream: IO[bytes], deadline: float) -> bytes | None:
    """One line from the child; b"" if it died first, None if the deadline came first."""
    chunks = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([stream], [], [], remaining)[0]:
            return None
        chunk = os.read(stream.fileno(), 1 << 16)
        if not chunk:
            return b""
        chunks.append(chunk)
        if chunk.endswith(b"\n"):  # the child writes one line and waits: nothing follows it
            return b"".join(chunks)


# One renderer for the process, like the model cache: every run and route renders through it.
_RENDERER = TemplateRenderer()
atexit.register(_RENDERER.close)


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _token_text(token: Any) -> str:
    """Special tokens in tokenizer_config.json are strings or {"content": ...} objects."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
